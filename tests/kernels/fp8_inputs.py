"""Inputs of the FP8 kernels' tests: activations spanning many magnitudes, scales spread over
their blocks in float64."""

import torch


def expand(scales: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """float64 per-element scales by index arithmetic (not the module's repeat_interleave)."""
    r, c = torch.arange(rows) // block[0], torch.arange(cols) // block[1]
    return scales.cpu().double()[r][:, c]


def random_activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Columns of magnitudes from 1e-3 to 1e3 (groups of very different scales), a zero row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k)[torch.randperm(k, generator=gen)]
    x[m // 2] = 0.0
    return x.to(dtype)
