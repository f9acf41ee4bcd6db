"""SwiGLU's ``silu(gate) * up`` on a fused gate/up projection whose gate and up columns are
interleaved (gate ``j`` at ``2j``, up ``j`` at ``2j + 1``, as the engine stores the weight) or, for
FP8 checkpoints' 128 x 128 blocks, side by side (gate ``j`` at ``j``, up ``j`` at ``size + j``),
one pass over memory; and the same rounded to FP8 per token for a down projection with FP8 weights
(the row held whole where it fits, else a pass for its largest magnitude and a second to store,
split over a few programs per token at small batches)."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels.device import pdl_options, wait_for_prior_grid
from nanovllm.kernels.fp8 import FP8, FP8_MAX, MIN_SCALE, quantize_per_token_group_ref, round_to_e4m3

_BLOCK = 1024  # output columns per program
_NUM_WARPS = 4
# the FP8 variant's (block, num_warps, chunks) up to / above _FP8_FEW_ROWS rows
# (benchmarks/bench_fp8_activations.py on Hopper)
_FP8_FEW_ROWS = 64
_FP8_TILES_FEW = (4096, 16, 3)
_FP8_TILES_MANY = (2048, 8, 1)


def silu_and_mul_ref(x: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """``x``: ``[tokens, 2 * size]``, gate and up interleaved (``halves``: gate then up). Returns
    ``[tokens, size]``: silu(gate) * up, each of the two ops rounded to ``x.dtype`` as Hugging
    Face's MLP rounds them."""
    if halves:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.silu(x[..., 0::2]) * x[..., 1::2]


def silu_and_mul_fp8_ref(
    x: torch.Tensor, halves: bool = False, group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`silu_and_mul_ref` (in ``x.dtype``) rounded to FP8 per token, as the per-channel FP8
    layers round their input, or per token and ``group`` features, as the block-scaled ones do:
    ``(values [tokens, size] e4m3, scale [tokens, 1] or [tokens, ceil(size / group)] float32)``."""
    h = silu_and_mul_ref(x, halves)
    rows = h.reshape(-1, h.shape[-1])
    return quantize_per_token_group_ref(rows, group=group or rows.shape[-1])


@triton.jit
def _swiglu(row_ptr, cols, mask, up_offset, PAIRED: tl.constexpr, STEP: tl.constexpr):
    """silu(gate) * up of columns ``cols`` of one row, each op rounded to the row's dtype, in
    fp32 (0 where masked). Gate ``j`` at ``STEP * j``, up ``j`` ``up_offset`` after it."""
    if PAIRED:  # interleaved: one [BLOCK, 2] load of (gate, up) pairs
        pairs = tl.load(row_ptr + 2 * cols[:, None] + tl.arange(0, 2)[None, :], mask=mask[:, None], other=0.0)
        gate, up = tl.split(pairs.to(tl.float32))
    else:  # two loads (interleaved: the second from the sectors the first brought in)
        gate = tl.load(row_ptr + STEP * cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(row_ptr + STEP * cols + up_offset, mask=mask, other=0.0).to(tl.float32)
    dtype = row_ptr.dtype.element_ty
    # silu rounded to the activation dtype before the product, as the reference does
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, size, stride_x, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    h = _swiglu(x_ptr + row * stride_x, cols, mask, 1, True, 2)
    tl.store(out_ptr + row * stride_out + cols, h.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_fp8(q_ptr, cols, mask, h, scale, FMAX: tl.constexpr):
    v = tl.clamp(tl.math.div_rn(h, scale), -FMAX, FMAX)
    tl.store(q_ptr + cols, round_to_e4m3(v).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["size", "stride_x", "up_offset"])
def _silu_and_mul_fp8_kernel(
    x_ptr, q_ptr, s_ptr, size, stride_x, chunk, up_offset,
    BLOCK: tl.constexpr, WHOLE_ROW: tl.constexpr, PAIRED: tl.constexpr, STEP: tl.constexpr,
    FMAX: tl.constexpr, SMIN: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Token ``program_id(0)``. ``WHOLE_ROW`` (``size <= BLOCK``): its values computed once and
    kept; else a pass over the row for its largest magnitude and a second that computes again and
    stores columns ``chunk * program_id(1) ...`` (a row split over programs: at a few tokens the
    row is in L2, and a single program walking it twice is bound by its loads' latency)."""
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * size
    if WHOLE_ROW:
        cols = tl.arange(0, BLOCK)
        h = _swiglu(x_row, cols, cols < size, up_offset, PAIRED, STEP)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(h), axis=0), FMAX), SMIN)
        _store_fp8(q_row, cols, cols < size, h, scale, FMAX)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, size, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_swiglu(x_row, cols, cols < size, up_offset, PAIRED, STEP)))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FMAX), SMIN)
        first = tl.program_id(1) * chunk
        for start in range(first, min(size, first + chunk), BLOCK):
            cols = start + tl.arange(0, BLOCK)
            h = _swiglu(x_row, cols, cols < size, up_offset, PAIRED, STEP)
            _store_fp8(q_row, cols, cols < size, h, scale, FMAX)
    if tl.program_id(1) == 0:
        tl.store(s_ptr + row, scale)


@triton.jit(do_not_specialize=["size", "stride_x", "up_offset"])
def _silu_and_mul_fp8_group_kernel(
    x_ptr, q_ptr, s_ptr, size, stride_x, up_offset,
    GROUP: tl.constexpr, GROUPS: tl.constexpr, STEP: tl.constexpr, FMAX: tl.constexpr, SMIN: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Token ``program_id(0)``, its groups of ``GROUP`` features ``GROUPS * program_id(1) ...``,
    each with its own scale (one pass: no row-wide maximum to wait for)."""
    wait_for_prior_grid(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < size
    h = _swiglu(x_ptr + row * stride_x, cols, mask, up_offset, False, STEP)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(h), axis=1), FMAX), SMIN)
    v = tl.clamp(tl.math.div_rn(h, scale[:, None]), -FMAX, FMAX)
    tl.store(q_ptr + row * size + cols, round_to_e4m3(v).to(q_ptr.dtype.element_ty), mask=mask)
    num_groups = tl.cdiv(size, GROUP)
    tl.store(s_ptr + row * num_groups + g, scale, mask=g < num_groups)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`silu_and_mul_ref` (gate and up interleaved); ``x`` needs unit
    stride in its last dimension."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension holds gate and up, so it must be even: {x.shape[-1]}")
    if x.stride(-1) != 1:
        raise ValueError("x needs a unit stride in the last dimension")
    size = x.shape[-1] // 2
    x2d = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2d.shape[0], size, dtype=x.dtype, device=x.device)
    if out.numel():
        grid = (x2d.shape[0], triton.cdiv(size, _BLOCK))
        _silu_and_mul_kernel[grid](
            x2d,
            out,
            size,
            x2d.stride(0),
            out.stride(0),
            BLOCK=_BLOCK,
            num_warps=_NUM_WARPS,
            **pdl_options(x2d.device),
        )
    return out.view(*x.shape[:-1], size)


def silu_and_mul_fp8(
    x: torch.Tensor,
    block: int | None = None,
    num_warps: int | None = None,
    chunks: int | None = None,
    paired: bool = False,
    halves: bool = False,
    group: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`silu_and_mul_fp8_ref` (up to exp's last bits); ``x`` 2-d with a
    unit stride in its last dimension, gate and up interleaved or (``halves``) side by side;
    ``group`` (a power of two): one scale per token and that many features. Outputs are
    contiguous. Per token, ``block`` (a power of two: output columns per step, the whole row in
    one when it fits), ``num_warps`` and ``chunks`` (programs per row, each storing a share of it)
    override the tiles; ``paired``: interleaved gate and up loaded as pairs (by default two
    strided loads, faster here)."""
    if x.dim() != 2 or x.shape[-1] % 2:
        raise ValueError(f"x must be 2-d with gate and up in an even last dimension: {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x needs a unit stride in the last dimension")
    if chunks is not None and chunks < 1:
        raise ValueError(f"chunks must be positive: {chunks}")
    if group is not None and (group < 1 or group & (group - 1)):
        raise ValueError(f"group must be a power of two: {group}")
    if paired and halves:
        raise ValueError("paired loads need gate and up interleaved, not halves")
    rows, size = x.shape[0], x.shape[1] // 2
    up_offset, step = (size, 1) if halves else (1, 2)
    q = torch.empty(rows, size, dtype=FP8, device=x.device)
    scale = torch.empty(rows, triton.cdiv(size, group) if group else 1, dtype=torch.float32, device=x.device)
    if rows and size and group:
        groups = max(1, min(_BLOCK // group, triton.next_power_of_2(scale.shape[1])))
        _silu_and_mul_fp8_group_kernel[(rows, triton.cdiv(scale.shape[1], groups))](
            x, q, scale, size, x.stride(0), up_offset,
            GROUP=group, GROUPS=groups, STEP=step, FMAX=FP8_MAX, SMIN=MIN_SCALE, num_warps=_NUM_WARPS,
            **pdl_options(x.device),
        )  # fmt: skip
    elif rows and size:
        default_block, default_warps, default_chunks = (
            _FP8_TILES_FEW if rows <= _FP8_FEW_ROWS else _FP8_TILES_MANY
        )
        block = block or min(default_block, triton.next_power_of_2(size))
        num_warps, chunks = num_warps or default_warps, chunks or default_chunks
        whole_row = size <= block
        chunk = size if whole_row else triton.cdiv(triton.cdiv(size, chunks), block) * block
        _silu_and_mul_fp8_kernel[(rows, triton.cdiv(size, chunk))](
            x, q, scale, size, x.stride(0), chunk, up_offset,
            BLOCK=block, WHOLE_ROW=whole_row, PAIRED=paired, STEP=step, FMAX=FP8_MAX, SMIN=MIN_SCALE,
            num_warps=num_warps, **pdl_options(x.device),
        )  # fmt: skip
    return q, scale
