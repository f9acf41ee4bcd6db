"""Attention kernels: each module holds a Triton kernel next to a plain-torch reference."""
