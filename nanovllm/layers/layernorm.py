"""RMSNorm, optionally fused with the residual add, optionally rounding its output to FP8."""

import torch
from torch import nn

from nanovllm.kernels.rms_norm import (
    MAX_HIDDEN,
    add_rms_norm_ref,
    rms_norm,
    rms_norm_fp8,
    rms_norm_fp8_ref,
    rms_norm_ref,
)
from nanovllm.layers.fp8 import QuantizedActivation


class RMSNorm(nn.Module):
    """``fp8_output``: the output rounded to FP8 per token (a :class:`QuantizedActivation`), for
    a consumer with per-channel FP8 weights, or per token and ``fp8_group`` features for one with
    block scales. On CUDA one Triton kernel adds, normalises (and rounds); on the CPU (and rows
    wider than the kernel holds) the torch references."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, fp8_output: bool = False, fp8_group: int | None = None
    ):
        super().__init__()
        self.eps, self.fp8_output, self.fp8_group = eps, fp8_output, fp8_group
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``."""
        on_kernel = x.is_cuda and x.shape[-1] <= MAX_HIDDEN
        if not (on_kernel or self.fp8_output):
            if residual is None:
                return rms_norm_ref(x, self.weight, self.eps)
            return add_rms_norm_ref(x, residual, self.weight, self.eps)
        rows = x.reshape(-1, x.shape[-1])
        res = None if residual is None else residual.reshape(rows.shape)
        if self.fp8_output:
            norm_fp8 = rms_norm_fp8 if on_kernel else rms_norm_fp8_ref
            values, scale, summed = norm_fp8(rows, self.weight, self.eps, res, self.fp8_group)
            out = QuantizedActivation(values, scale, x.dtype)
        else:
            normed, summed = rms_norm(rows, self.weight, self.eps, res)
            out = normed.view(x.shape)
        return out if residual is None else (out, summed.view(x.shape))
