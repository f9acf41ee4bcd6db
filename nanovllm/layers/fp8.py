"""FP8 weights: a linear layer's weight held in float8 e4m3, its input quantized per token on the
fly, as vLLM's dynamic FP8 does. Three layouts:

- ``"fp8"`` (``quantization="fp8"``): one float32 scale per output channel, the weight quantized
  from the model dtype as it is loaded; the input one scale per token.
- ``"fp8_tensor"`` (FP8 checkpoints with one ``weight_scale`` per tensor, as AutoFP8 writes them):
  the e4m3 weight as stored, the tensor's scale given to each of its rows, so the layer is the
  ``"fp8"`` one (packed q/k/v or gate/up parts keep their own scales).
- ``"fp8_block"`` (FP8 checkpoints, ``weight_block_size: [128, 128]``, as Qwen3-*-FP8): the
  checkpoint's e4m3 weight as stored, its ``weight_scale_inv`` one row per 128 x 128 block
  (``[out / 128, ceil(in / 128)]``) where each 128 rows of the rank's weight are one block's rows,
  else one row per output row (``[out, ceil(in / 128)]``: a rank's part of a block); the input one
  scale per token and 128 features.

On CPU the product is computed in float64: products of e4m3 values are exact there, and so are
their sums over up to 2,048 input features, so the result does not depend on how a matrix library
orders them (the tests' oracle rounds the same way). On CUDA the input is quantized by a Triton
kernel and the product runs on fp8 tensor cores with fp32 sums: per-channel weights through
cuBLAS (``torch._scaled_mm`` with row-wise scales, fast accumulation) from :data:`CUBLAS_MIN_ROWS`
rows, below that the Triton GEMM of ``kernels/fp8_gemm.py`` (``benchmarks/bench_fp8.py --sweep``:
to 64 rows it reads the weight 1.4-1.6x faster than cuBLAS, at 128 rows they tie, from 192 cuBLAS
is ahead); block scales kept per block through cuBLAS's 1 x 128 / 128 x 128 scaled product from
:data:`CUBLAS_BLOCK_MIN_ROWS` rows (where the weight's groups allow it:
:data:`CUBLAS_BLOCK_SCALE_ALIGN`), else (and per row) the Triton GEMM."""

from typing import NamedTuple

import torch

from nanovllm.kernels.fp8 import (
    FP8,
    GROUP,
    quantize_per_token_group,
    quantize_per_token_group_ref,
    quantize_weight_blockwise_ref,
    quantize_weight_per_channel_ref,
)
from nanovllm.kernels.fp8_gemm import (
    fp8_channel_gemm_ref,
    fp8_gemm,
    fp8_row_group_gemm_ref,
)

PER_ROW_SCALED = ("fp8", "fp8_tensor")
"""The layouts whose weights carry one scale per output row (quantized at load, or an FP8
checkpoint's per-tensor scale given to each row): their inputs are rounded per token."""


class QuantizedActivation(NamedTuple):
    """A layer's input already rounded to FP8 by the op that produced it (with per-channel
    weights: the RMSNorm before q/k/v and gate/up, the SwiGLU before down), so that no separate
    pass quantizes it: ``values`` ``[tokens, features]`` e4m3, ``scale`` ``[tokens, 1]`` per
    token (``[tokens, groups]`` per token and 128 features for block scales), ``dtype`` the
    model dtype the layer returns."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


CUBLAS_MIN_ROWS = 129
CUBLAS_BLOCK_MIN_ROWS = 128
CUBLAS_ALIGN = 16  # cuBLAS's fp8 GEMMs need both matrix widths divisible by 16
CUBLAS_BLOCK_SCALE_ALIGN = 4
"""cuBLAS's block-scaled product reads both scale matrices with a leading dimension of a multiple
of 4 floats (16 bytes): the activation scales' rows are padded to it, and weights whose group count
(``in / 128``) is not a multiple of it take the Triton GEMM (their scales read wrong otherwise)."""


def quantize_weight(loaded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's ``[out, in]`` weight as ``(fp8 weight, scale [out])``, each row scaled over
    its whole length (before any tensor-parallel split, so every rank agrees)."""
    if not loaded.is_floating_point():
        raise ValueError(f"has dtype {loaded.dtype}, expected a floating-point tensor")
    if loaded.is_meta:  # a dry run of the loaders: shapes only
        return loaded.to(FP8), loaded[:, 0].float()
    return quantize_weight_per_channel_ref(loaded)


def _rows(x: torch.Tensor | QuantizedActivation, group: int):
    """``(x_fp8, x_scales, dtype, leading shape)`` of a layer's input, quantized here unless it
    comes quantized."""
    if isinstance(x, QuantizedActivation):
        return x.values, x.scale, x.dtype, x.values.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    group = group or rows.shape[-1]
    quantize = quantize_per_token_group if rows.is_cuda else quantize_per_token_group_ref
    return *quantize(rows, group=group), x.dtype, x.shape[:-1]


def fp8_linear(
    x: torch.Tensor | QuantizedActivation,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x @ dequant(weight).T (+ bias)`` with ``x`` rounded to FP8 per token (unless it comes
    rounded), in the model dtype."""
    x_fp8, x_scale, dtype, lead = _rows(x, 0)
    (m, k), n = x_fp8.shape, weight.shape[0]
    if not x_fp8.is_cuda:
        y = fp8_channel_gemm_ref(x_fp8, x_scale, weight, scale, dtype)
    else:
        aligned = not (k % CUBLAS_ALIGN or n % CUBLAS_ALIGN)
        if m >= CUBLAS_MIN_ROWS and dtype == torch.bfloat16 and aligned:
            # sums kept in the tensor cores' accumulator across K, as the Triton GEMM keeps them:
            # 1.05-1.16x cuBLAS's periodic fp32 promotion from 192 rows (benchmarks/bench_fp8.py)
            y = torch._scaled_mm(
                x_fp8, weight.T, x_scale, scale.view(1, n), out_dtype=dtype, use_fast_accum=True
            )
        else:
            y = fp8_gemm(x_fp8, x_scale, weight, scale, dtype)
    if bias is not None:
        y = y + bias
    return y.view(*lead, n)


def quantize_weight_blocks(loaded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A model-dtype ``[out, in]`` weight (an update of an FP8 checkpoint's model) as the
    checkpoint would hold it: ``(fp8 weight, scale_inv [ceil(out / 128), ceil(in / 128)])``."""
    if not loaded.is_floating_point():
        raise ValueError(f"has dtype {loaded.dtype}, expected a floating-point tensor")
    if loaded.is_meta:
        blocks = (-(-loaded.shape[0] // GROUP), -(-loaded.shape[1] // GROUP))
        return loaded.to(FP8), torch.empty(blocks, device="meta")
    return quantize_weight_blockwise_ref(loaded)


def block_scales_per_row(scale_inv: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """``[..., ceil(out / 128), groups]`` block scales as one row of group scales per output row
    (float32; the first ``rows`` of them where given)."""
    per_row = scale_inv.float().repeat_interleave(GROUP, dim=-2)
    return per_row if rows is None else per_row[..., :rows, :]


def fp8_block_linear(
    x: torch.Tensor | QuantizedActivation,
    weight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x @ dequant(weight).T (+ bias)``: ``x`` rounded to FP8 per token and 128 features (unless
    it comes rounded), the weight's groups of 128 input features scaled by ``scales``, one row per
    128 x 128 block (``[out / 128, groups]``) or per output row (``[out, groups]``), in the model
    dtype."""
    x_fp8, x_scales, dtype, lead = _rows(x, GROUP)
    (m, k), n = x_fp8.shape, weight.shape[0]
    per_block = scales.shape[0] != n
    cublas_layout = not (k % GROUP or n % GROUP or scales.shape[1] % CUBLAS_BLOCK_SCALE_ALIGN)
    cublas = per_block and cublas_layout and m >= CUBLAS_BLOCK_MIN_ROWS and dtype == torch.bfloat16
    if not x_fp8.is_cuda:
        row_scales = block_scales_per_row(scales, n) if per_block else scales
        y = fp8_row_group_gemm_ref(x_fp8, x_scales, weight, row_scales, dtype)
    elif cublas:
        y = _cublas_block_product(x_fp8, x_scales, weight, scales, dtype)
    else:
        y = fp8_gemm(x_fp8, x_scales, weight, scales, dtype)
    if bias is not None:
        y = y + bias
    return y.view(*lead, n)


def _cublas_block_product(
    x_fp8: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, dtype
) -> torch.Tensor:
    """cuBLAS's product with 1 x 128 activation and 128 x 128 weight scales: it takes the
    activation scales column-major, the weight's ``[out / 128, groups]`` contiguous and
    transposed, and rows in multiples of :data:`CUBLAS_BLOCK_SCALE_ALIGN` (others padded with zeros
    here). ``benchmarks/bench_fp8.py``, the 8B layer on an H200, quantizer included: 1.13x bf16 at
    256 rows, 1.31-1.37x at 1,024-4,096, where the Triton block GEMM is 0.78-0.85x; at 64 rows
    the Triton GEMM is faster, at 128 cuBLAS."""
    m, k = x_fp8.shape
    rows = -(-m // CUBLAS_BLOCK_SCALE_ALIGN) * CUBLAS_BLOCK_SCALE_ALIGN
    if rows != m:
        padding = x_fp8.new_zeros(rows - m, k, dtype=torch.uint8)
        x_fp8 = torch.cat([x_fp8.view(torch.uint8), padding]).view(FP8)
    col_major = x_scales.new_ones(x_scales.shape[1], rows)
    col_major[:, :m] = x_scales.t()
    y = torch._scaled_mm(x_fp8, weight.T, col_major.t(), scales.t(), out_dtype=dtype)
    return y[:m]
