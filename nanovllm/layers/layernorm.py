"""RMSNorm, optionally fused with the residual add, optionally rounding its output to FP8."""

import torch
from torch import nn

from nanovllm.layers.fp8 import QuantizedActivation, quantize_per_token


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x.to(dtype) * weight


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(x, weight, eps), x


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_token(rms_norm(x, weight, eps))


def add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    normed, residual = add_rms_norm(x, residual, weight, eps)
    return quantize_per_token(normed), residual


class RMSNorm(nn.Module):
    """``fp8_output``: the output rounded to FP8 per token (a :class:`QuantizedActivation`), for
    a consumer with per-channel FP8 weights: compiled, the rounding costs no pass of its own."""

    compilable = ("norm_fn", "add_norm_fn")

    def __init__(self, hidden_size: int, eps: float = 1e-6, fp8_output: bool = False):
        super().__init__()
        self.eps, self.fp8_output = eps, fp8_output
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        if fp8_output:
            self.norm_fn, self.add_norm_fn = rms_norm_fp8, add_rms_norm_fp8
        else:
            self.norm_fn, self.add_norm_fn = rms_norm, add_rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            out = self.norm_fn(x, self.weight, self.eps)
        else:
            out, residual = self.add_norm_fn(x, residual, self.weight, self.eps)
        if self.fp8_output:
            out = QuantizedActivation(*out, x.dtype)
        return out if residual is None else (out, residual)
