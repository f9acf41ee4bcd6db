"""FP8 (e4m3) formats and rounding: activations quantized on the fly, weights block- or
channel-scaled (the product of the two: ``kernels/fp8_gemm.py``).

Layouts, as in Qwen3-*-FP8 / DeepSeek checkpoints (``"weight_block_size": [128, 128]``):

- activations ``x [M, K]`` per token and group of ``group`` (128) input features:
  ``x ~ x_fp8 * scales[m, k // group]``, the scale ``max |x| over the group / 448``;
- weights ``w [N, K]`` per 128 x 128 block: ``w ~ w_fp8 * scale_inv[n // 128, k // 128]``
  (the checkpoints' ``weight_scale_inv``: it multiplies, despite its name);
- or per output channel, ``w ~ w_fp8 * scale[n]`` (``LLM(quantization="fp8")`` from a 16-bit
  checkpoint), with per-token activations.

Quantizing divides by the scale, clamps to e4m3's +-448 and rounds to nearest, ties to even (as
``.to(torch.float8_e4m3fn)`` does); a scale is never below :data:`MIN_SCALE`, so an all-zero group
quantizes to zeros.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels.device import pdl_options, wait_for_prior_grid

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = torch.finfo(torch.float32).tiny  # float32's smallest normal
GROUP = 128  # input features per scale of the block GEMM; 128 x 128 weight blocks
_QUANT_TILE = 1024  # elements per program of the quantizer (whole groups, at least one)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _dequantize_ref(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``q`` in float32, each ``block[0] x block[1]`` block times its entry of ``scales``."""
    rows, cols = q.shape
    full = scales.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * full[:rows, :cols]


def _quantize_blocks_ref(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` scaled per ``block`` (edge blocks shorter): ``(x_fp8, scales)``."""
    if x.dim() != 2:
        raise ValueError(f"expected a 2-d tensor, got shape {tuple(x.shape)}")
    (rows, cols), (br, bc) = x.shape, block
    nr, nc = triton.cdiv(rows, br), triton.cdiv(cols, bc)
    padded = F.pad(x.float(), (0, nc * bc - cols, 0, nr * br - rows)).view(nr, br, nc, bc)
    amax = padded.abs().amax(dim=(1, 3))
    # a tensor divisor, not the number: CUDA divides by a number as a product with its reciprocal
    scales = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    q = (padded / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(nr * br, nc * bc)[:rows, :cols].contiguous(), scales


def quantize_per_token_group_ref(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference: ``x [M, K]`` to ``(x_fp8 [M, K], scales [M, ceil(K / group)] float32)``
    (the last group shorter when ``group`` does not divide K; ``group = K``: per token)."""
    return _quantize_blocks_ref(x, (1, group))


def quantize_weight_per_channel_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` to ``(w_fp8 [N, K], scale [N] float32)``, one scale per output channel."""
    q, scale = _quantize_blocks_ref(w, (1, w.shape[-1]))
    return q, scale.view(-1)


def quantize_weight_blockwise_ref(
    w: torch.Tensor, block: tuple[int, int] = (GROUP, GROUP)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` to ``(w_fp8 [N, K], scale_inv [ceil(N / block[0]), ceil(K / block[1])] float32)``,
    as Qwen3-*-FP8 checkpoints hold their linear weights."""
    return _quantize_blocks_ref(w, block)


def dequantize_blockwise_ref(
    q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = (GROUP, GROUP)
) -> torch.Tensor:
    """float32 values of ``q`` scaled per ``block``: weights as stored, activations with
    ``block = (1, group)``."""
    return _dequantize_ref(q, scales, block)


@triton.jit
def round_to_e4m3(v):
    """fp32 ``v`` (|v| <= 448) rounded to e4m3's grid, ties to even, still fp32: the cast that
    follows is then exact on every backend (Triton's interpreter rounds ties away from zero and
    can lose the carry into the exponent: 127.9 to 64)."""
    bits = v.to(tl.uint32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF).to(tl.int32) - 127, -6)  # -6: e4m3's least normal
    # 2^(exp + 20): the sum's ulp is e4m3's at exponent exp, so the add rounds as e4m3 does
    magic = ((exp + 147) << 23).to(tl.float32, bitcast=True)
    r = (tl.abs(v) + magic) - magic
    return (r.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["K", "num_groups", "stride_xm"])
def _quantize_group_kernel(
    x_ptr, q_ptr, s_ptr, K, num_groups, stride_xm,
    GROUP_SIZE: tl.constexpr, BLOCK: tl.constexpr, GROUPS: tl.constexpr, FMAX: tl.constexpr,
    SMIN: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Row ``program_id(0)``, groups ``GROUPS * program_id(1) ...`` as a ``[GROUPS, BLOCK]`` tile."""
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, BLOCK)
    cols = g[:, None] * GROUP_SIZE + j[None, :]
    mask = (j[None, :] < GROUP_SIZE) & (cols < K)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), FMAX), SMIN)
    v = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FMAX, FMAX)
    tl.store(q_ptr + row * K + cols, round_to_e4m3(v).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * num_groups + g, scale, mask=g < num_groups)


def quantize_per_token_group(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`quantize_per_token_group_ref` (bit for bit on finite inputs);
    ``x`` fp32/fp16/bf16 with a unit stride in its last dimension. Outputs are contiguous."""
    if x.dim() != 2 or x.dtype not in OUT_DTYPES:
        raise ValueError(f"x must be a 2-d fp32/fp16/bf16 tensor: {x.dtype}, {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x needs a unit stride in the last dimension")
    if group < 1:
        raise ValueError(f"group must be positive: {group}")
    m, k = x.shape
    num_groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scales = torch.empty(m, num_groups, dtype=torch.float32, device=x.device)
    if not m or not k:
        return q, scales
    block = triton.next_power_of_2(group)
    groups = max(1, min(_QUANT_TILE // block, triton.next_power_of_2(num_groups)))
    _quantize_group_kernel[(m, triton.cdiv(num_groups, groups))](
        x, q, scales, k, num_groups, x.stride(0),
        GROUP_SIZE=group, BLOCK=block, GROUPS=groups, FMAX=FP8_MAX, SMIN=MIN_SCALE,
        num_warps=min(16, max(4, block * groups // 256)), **pdl_options(x.device),
    )  # fmt: skip
    return q, scales
