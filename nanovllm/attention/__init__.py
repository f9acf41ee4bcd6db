"""Attention backends behind one small interface, chosen by name."""

import importlib.util

import torch

from nanovllm.attention.backend import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def get_attention_backend(name: str, device: torch.device, block_size: int) -> AttentionBackend:
    """Resolve "auto" (flash-attn, else Triton on CUDA; torch on CPU) and build the backend."""
    if name == "auto":
        if device.type != "cuda":
            name = "torch"
        elif flash_attn_available() and block_size % 256 == 0:
            name = "flash_attn"
        else:
            name = "triton"
    if name == "flash_attn":
        if device.type != "cuda" or not flash_attn_available():
            raise ValueError("attention_backend='flash_attn' needs CUDA and the flash-attn package")
        if block_size % 256:
            raise ValueError(f"flash-attn needs kvcache_block_size to be a multiple of 256, got {block_size}")
        from nanovllm.attention.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    if name == "triton":
        if block_size < 16:
            raise ValueError(f"the Triton backend needs kvcache_block_size >= 16, got {block_size}")
        from nanovllm.attention.triton_backend import TritonBackend

        return TritonBackend()
    from nanovllm.attention.torch_backend import TorchBackend

    return TorchBackend()
