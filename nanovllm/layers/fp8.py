"""FP8 weights (``quantization="fp8"``): a linear layer's weight held in float8 e4m3 with one
float32 scale per output channel, quantized from the model-dtype weight as it is loaded; the
layer's input quantized per token on the fly, as vLLM's dynamic FP8 does.

The product is computed here in float64 on every device for now: products of e4m3 values are
exact there, and so are their sums over up to 2,048 input features, so the result does not
depend on how a matrix library orders them (exact, not yet fast); the CUDA kernels
(``kernels/fp8.py``) take its place once measured.
"""

import torch

from nanovllm.kernels.fp8 import (
    FP8,
    quantize_per_token_group_ref,
    quantize_weight_per_channel_ref,
)


def quantize_weight(loaded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's ``[out, in]`` weight as ``(fp8 weight, scale [out])``, each row scaled over
    its whole length (before any tensor-parallel split, so every rank agrees)."""
    if not loaded.is_floating_point():
        raise ValueError(f"has dtype {loaded.dtype}, expected a floating-point tensor")
    if loaded.is_meta:  # a dry run of the loaders: shapes only
        return loaded.to(FP8), loaded[:, 0].float()
    return quantize_weight_per_channel_ref(loaded)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ dequant(weight).T (+ bias)`` with ``x`` rounded to FP8 per token, in ``x``'s dtype."""
    rows = x.reshape(-1, x.shape[-1])
    x_fp8, x_scale = quantize_per_token_group_ref(rows, group=rows.shape[-1])
    y = fp8_product(x_fp8, x_scale, weight, scale).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_product(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``(x_fp8 @ weight.T) * x_scale * scale`` in float64 (``x_scale`` ``[rows, 1]``, ``scale``
    ``[out]``)."""
    return (x_fp8.double() @ weight.double().T) * x_scale.double() * scale.double()
