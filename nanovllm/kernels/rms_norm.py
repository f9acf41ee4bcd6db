"""RMSNorm, optionally after the residual add, in the model dtype or rounded to FP8 per token for
projections with per-channel FP8 weights, or per token and 128 features for block-scaled ones
(one program per token: the row stays in registers from the add to the rounding)."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import pdl_options, wait_for_prior_grid
from nanovllm.kernels.fp8 import FP8, FP8_MAX, MIN_SCALE, quantize_per_token_group_ref, round_to_e4m3

MAX_HIDDEN = 16384  # a row per program, held whole


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Qwen3/Llama RMSNorm: normalised in fp32, rounded to ``x.dtype``, times
    ``weight`` in that dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x.to(dtype) * weight


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``, the sum rounded to ``x.dtype`` first."""
    x = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(x, weight, eps), x


def rms_norm_fp8_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The norm (after the residual add when ``residual`` is given) rounded to FP8 per token, or
    per token and ``group`` features: ``(values [tokens, hidden] e4m3, scale [tokens, 1] or
    [tokens, ceil(hidden / group)] float32, x + residual or None)``."""
    if residual is not None:
        normed, residual = add_rms_norm_ref(x, residual, weight, eps)
    else:
        normed = rms_norm_ref(x, weight, eps)
    rows = normed.reshape(-1, normed.shape[-1])
    return *quantize_per_token_group_ref(rows, group=group or rows.shape[-1]), residual


@triton.jit(do_not_specialize=["eps", "stride_x", "stride_r"])
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, sum_ptr, hidden, eps, stride_x, stride_r,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
    FMAX: tl.constexpr, SMIN: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Token ``program_id(0)``. Not ``QUANT``: the norm stored in ``q_ptr``'s dtype. ``QUANT``:
    rounded to e4m3 with ``GROUP`` 0 one scale for the row, else one per ``GROUP`` features (a
    power of two dividing ``BLOCK``)."""
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype)
        tl.store(sum_ptr + row * hidden + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = ((x * inv).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
    if not QUANT:
        tl.store(q_ptr + row * hidden + cols, y.to(q_ptr.dtype.element_ty), mask=mask)
    elif GROUP == 0:
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), FMAX), SMIN)
        v = tl.clamp(tl.math.div_rn(y, scale), -FMAX, FMAX)
        tl.store(q_ptr + row * hidden + cols, round_to_e4m3(v).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)
    else:
        groups = tl.cdiv(hidden, GROUP)
        y = tl.reshape(y, (BLOCK // GROUP, GROUP))
        cols = tl.reshape(cols, (BLOCK // GROUP, GROUP))
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=1), FMAX), SMIN)
        v = tl.clamp(tl.math.div_rn(y, scale[:, None]), -FMAX, FMAX)
        q = round_to_e4m3(v).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + row * hidden + cols, q, mask=cols < hidden)
        g = tl.arange(0, BLOCK // GROUP)
        tl.store(s_ptr + row * groups + g, scale, mask=g < groups)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.shape != x.shape[1:] or (residual is not None and residual.shape != x.shape):
        raise ValueError(
            f"x must be 2-d, weight [hidden] and residual x's shape: {tuple(x.shape)}, "
            f"{tuple(weight.shape)}, {None if residual is None else tuple(residual.shape)}"
        )
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("x and residual need a unit stride in the last dimension")
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[1]} is above the kernel's {MAX_HIDDEN}")


def _launch(x, weight, eps, residual, out, scale, group: int | None) -> torch.Tensor | None:
    """The kernel over ``x``'s rows into ``out`` (and ``scale`` when quantizing); returns the sum
    ``x + residual`` (or None)."""
    rows, hidden = x.shape
    summed = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    if rows and hidden:
        block = max(triton.next_power_of_2(hidden), group or 1)
        _rms_norm_kernel[(rows,)](
            x, x if residual is None else residual, weight, out, out if scale is None else scale,
            out if summed is None else summed, hidden, eps, x.stride(0),
            0 if residual is None else residual.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK=block, QUANT=scale is not None, GROUP=group or 0,
            FMAX=FP8_MAX, SMIN=MIN_SCALE, num_warps=min(16, max(4, block // 512)), **pdl_options(x.device),
        )  # fmt: skip
    return summed


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of :func:`rms_norm_ref`, or with ``residual`` of :func:`add_rms_norm_ref`
    (up to the last bits of the sum of squares and the reciprocal square root): ``(norm, x +
    residual or None)``; ``x`` and ``residual`` 2-d with unit strides in their last dimension,
    ``weight`` in ``x.dtype``, at most :data:`MAX_HIDDEN` features. Outputs are contiguous."""
    _check(x, weight, residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out, _launch(x, weight, eps, residual, out, None, None)


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton version of :func:`rms_norm_fp8_ref` (up to the last bits of the sum of squares and
    the reciprocal square root); ``x`` and ``residual`` 2-d with unit strides in their last
    dimension, ``weight`` in ``x.dtype``, ``group`` a power of two. Outputs are contiguous."""
    _check(x, weight, residual)
    if group is not None and (group < 1 or group & (group - 1)):
        raise ValueError(f"group must be a power of two: {group}")
    rows, hidden = x.shape
    q = torch.empty(rows, hidden, dtype=FP8, device=x.device)
    num_scales = triton.cdiv(hidden, group) if group else 1
    scale = torch.empty(rows, num_scales, dtype=torch.float32, device=x.device)
    return q, scale, _launch(x, weight, eps, residual, q, scale, group)
