"""Mixture-of-experts SwiGLU experts (Qwen3-MoE / Mixtral) as two grouped GEMMs, beside a torch
reference; the experts' weights in the activation dtype, or in float8 e4m3 (``quantization="fp8"``).

Rounding, shared by both (and Hugging Face's ``Qwen3MoeExperts``): the gate and up projections,
silu, its product with up and the down projection are each rounded to the activation dtype, as
HF's ``F.linear`` / ``act_fn`` calls are. The routing weight multiplies the rounded down output in
fp32 and the product is rounded once (HF multiplies by the weight already cast to the activation
dtype: pass ``topk_weights`` rounded to it for the same result). The ``top_k`` weighted outputs of a
token are summed in fp32 and rounded once, in a fixed order (deterministic); HF ``index_add_``s them
in the activation dtype expert by expert: the same result for ``top_k <= 2`` (tested bit for bit
in bf16), one rounding more per extra expert otherwise.

FP8: ``w13`` / ``w2`` hold e4m3 values with one float32 scale per expert and output row
(``w13_scale [experts, 2 * inter]``, ``w2_scale [experts, hidden]``). Each GEMM's input is rounded
to e4m3 first, one scale per row over the whole row (a token's hidden state for gate / up; a
pair's ``silu(gate) * up``, already rounded to the activation dtype, for down); the product of
the e4m3 values is scaled by row scale x weight scale and rounded to the activation dtype where
the 16/32-bit product is. The reference computes each product in float64, where products of e4m3
values and their sums are exact (a matrix library's order cannot change them). The kernels sum
on fp8 tensor cores: with per-row scales the sums stay in the tensor cores' accumulator across K
(fast accumulation, as the dense layers' ``torch._scaled_mm`` runs; Hopper adds into it with ~14
bits of precision), or with ``FAST_ACCUM=False`` each K step is summed apart and added in fp32
(Triton does not fold ``acc + dot`` for fp8 on Hopper). An FP8 checkpoint's experts
(``weight_block_size: [128, 128]``) keep their block scales per row and 128 input features
(``w13_scale [experts, 2 * inter, ceil(hidden / 128)]``, ``w2_scale [experts, hidden, ceil(inter
/ 128)]``), and each GEMM's input is rounded per row and 128 features; the kernels scale each K
step's sums by its group's scales, the reference dequantizes both sides in float64.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels.device import capability
from nanovllm.kernels.fp8 import (
    FP8,
    GROUP,
    quantize_per_token_group,
    quantize_per_token_group_ref,
)
from nanovllm.kernels.fp8_gemm import (
    fp8_channel_gemm_ref,
    fp8_row_group_gemm_ref,
)
from nanovllm.kernels.moe_align import moe_align

ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
) -> tuple[bool, bool]:
    """``ValueError`` unless the arguments fit together; returns whether the weights are FP8 and
    whether their scales are per 128 input features (block scales) rather than per row."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x, w13, w2 must be 2-d, 3-d, 3-d: {x.dim()}, {w13.dim()}, {w2.dim()}")
    tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    if w13.shape != (num_experts, 2 * inter, hidden) or w2.shape[1] != hidden:
        raise ValueError(
            f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit [experts, 2 * inter, {hidden}] / "
            f"[experts, {hidden}, inter]"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
            f"be [{tokens}, top_k]"
        )
    if not topk_weights.dtype.is_floating_point:
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    fp8 = w13.dtype == FP8
    if fp8:
        if x.dtype not in ACT_DTYPES or w2.dtype != FP8:
            raise ValueError(f"x must be fp32/fp16/bf16 and w2 e4m3 like w13: {x.dtype}, {w2.dtype}")
        if w13_scale is None or w2_scale is None:
            raise ValueError("e4m3 weights need w13_scale and w2_scale")
        grouped = w13_scale.dim() == 3
        per_row = (w13.shape[:2], w2.shape[:2])
        per_group = ((*w13.shape[:2], triton.cdiv(hidden, GROUP)), (*w2.shape[:2], triton.cdiv(inter, GROUP)))
        if (w13_scale.shape, w2_scale.shape) not in (per_row, per_group):
            raise ValueError(
                f"w13_scale {tuple(w13_scale.shape)} / w2_scale {tuple(w2_scale.shape)} must be "
                f"{tuple(per_row[0])} / {tuple(per_row[1])} (one per expert and output row) or "
                f"{per_group[0]} / {per_group[1]} (per expert, row and {GROUP} input features)"
            )
        if w13_scale.dtype != torch.float32 or w2_scale.dtype != torch.float32:
            raise ValueError(f"weight scales must be float32: {w13_scale.dtype}, {w2_scale.dtype}")
    else:
        if x.dtype not in ACT_DTYPES or not x.dtype == w13.dtype == w2.dtype:
            raise ValueError(f"x, w13, w2 must share one float dtype: {x.dtype}, {w13.dtype}, {w2.dtype}")
        if w13_scale is not None or w2_scale is not None:
            raise ValueError(f"weight scales go with e4m3 weights, not {w13.dtype}")
        grouped = False
    return fp8, grouped


def _expert_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, w)``; for an e4m3 ``w``, ``x`` rounded to e4m3 as ``w`` is scaled (per row
    with ``w_scale [rows]``, per row and 128 features with ``w_scale [rows, groups]``) and the
    product computed in float64, rounded to ``x``'s dtype."""
    if w_scale is None:
        return F.linear(x, w)
    if w_scale.dim() == 2:
        return fp8_row_group_gemm_ref(*quantize_per_token_group_ref(x, group=GROUP), w, w_scale, x.dtype)
    return fp8_channel_gemm_ref(*quantize_per_token_group_ref(x, group=x.shape[1]), w, w_scale, x.dtype)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-expert torch loop. ``x`` ``[tokens, hidden]``; ``w13`` ``[experts, 2 * inter, hidden]``
    (gate rows then up rows); ``w2`` ``[experts, hidden, inter]``; ``topk_weights`` /
    ``topk_ids`` ``[tokens, top_k]``. Returns ``[tokens, hidden]`` in ``x.dtype``:
    ``sum_k weight_k * down(silu(gate(x)) * up(x))`` over the token's experts (syncs with the host).
    e4m3 ``w13`` / ``w2`` take their scales ``w13_scale [experts, 2 * inter]`` / ``w2_scale
    [experts, hidden]`` (float32, per row), or ``[experts, 2 * inter, ceil(hidden / 128)]`` /
    ``[experts, hidden, ceil(inter / 128)]`` (per row and 128 input features: an FP8 checkpoint's
    block scales), and run as the module docstring says."""
    _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    tokens, top_k = topk_ids.shape
    out = torch.zeros(tokens, top_k, x.shape[1], dtype=x.dtype, device=x.device)
    for e in topk_ids.unique().tolist():
        kpos, tok = torch.where(topk_ids.t() == e)  # HF's row order: by k, then by token
        gate, up = _expert_linear(x[tok], w13[e], None if w13_scale is None else w13_scale[e]).chunk(2, -1)
        h = _expert_linear(F.silu(gate) * up, w2[e], None if w2_scale is None else w2_scale[e])
        out[tok, kpos] = (h.float() * topk_weights[tok, kpos, None].float()).to(x.dtype)
    return out.sum(1, dtype=torch.float32).to(x.dtype)


@triton.jit
def _block_and_column(num_blocks, columns, group_blocks):
    """This program's (block of pairs, column tile): ``group_blocks`` blocks at a time, their
    column tiles in turn, so the programs in flight share those blocks' activations in L2 (with
    ``group_blocks`` >= ``num_blocks``, every block's tile of one column before the next column)."""
    pid = tl.program_id(0)
    per_group = group_blocks * columns
    first = (pid // per_group) * group_blocks
    in_group = min(num_blocks - first, group_blocks)
    return first + (pid % per_group) % in_group, (pid % per_group) // in_group


@triton.jit(do_not_specialize=["num_pairs", "num_blocks", "group_blocks"])
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ids_ptr, expert_of_block_ptr, num_padded_ptr, x_scale_ptr, w_scale_ptr,
    num_pairs, top_k, hidden, inter, num_blocks, group_blocks,
    stride_xm, stride_we, stride_wn, stride_wk, stride_om, stride_xsm, stride_wse, stride_wsn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr, GROUP_K: tl.constexpr, FAST_ACCUM: tl.constexpr,
):  # fmt: skip
    """out[pair, n] = silu(x[token] @ gate[e, n]) * (x[token] @ up[e, n]) for one block of pairs.
    ``FP8``: ``x`` and ``w`` hold e4m3 values, scaled per token (``x_scale``) and per expert and
    row (``w_scale``) once the sums are done (kept in the MMA's accumulator with ``FAST_ACCUM``);
    with ``GROUP_K`` (block scales) per token and ``GROUP_K`` features and per expert, row and
    ``GROUP_K`` features, each K step's sums scaled by its group's (``BLOCK_K`` divides
    ``GROUP_K``)."""
    pid_m, pid_n = _block_and_column(num_blocks, tl.cdiv(inter, BLOCK_N), group_blocks)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):  # the grid is sized for the worst case
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    e = tl.load(expert_of_block_ptr + pid_m).to(tl.int64)
    valid = rows < num_pairs
    tokens = (rows // top_k).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xm + k[None, :]
    # [BLOCK_K, BLOCK_N] tiles of w^T; the up rows sit ``inter`` rows below the gate rows
    g_ptrs = w_ptr + e * stride_we + n[None, :] * stride_wn + k[:, None] * stride_wk
    u_ptrs = g_ptrs + inter * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        a = tl.load(x_ptrs, mask=valid[:, None] & (k[None, :] < hidden - k0), other=0.0)
        w_mask = (n[None, :] < inter) & (k[:, None] < hidden - k0)
        g = tl.load(g_ptrs, mask=w_mask, other=0.0)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0)
        if FP8 and GROUP_K:
            group = k0 // GROUP_K
            x_s = tl.load(x_scale_ptr + tokens * stride_xsm + group, mask=valid, other=0.0)[:, None]
            s_ptrs = w_scale_ptr + e * stride_wse + n * stride_wsn + group
            g_s = tl.load(s_ptrs, mask=n < inter, other=0.0)[None, :]
            u_s = tl.load(s_ptrs + inter * stride_wsn, mask=n < inter, other=0.0)[None, :]
            gate += tl.dot(a, g) * x_s * g_s
            up += tl.dot(a, u) * x_s * u_s
        elif FP8 and not FAST_ACCUM:  # each step summed apart, then added in fp32
            gate += tl.dot(a, g)
            up += tl.dot(a, u)
        else:
            gate = tl.dot(a, g, gate, input_precision=DOT_PRECISION)
            up = tl.dot(a, u, up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    if FP8 and not GROUP_K:
        x_s = tl.load(x_scale_ptr + tokens * stride_xsm, mask=valid, other=0.0)[:, None]
        s_ptrs = w_scale_ptr + e * stride_wse + n * stride_wsn
        gate = gate * x_s * tl.load(s_ptrs, mask=n < inter, other=0.0)[None, :]
        up = up * x_s * tl.load(s_ptrs + inter * stride_wsn, mask=n < inter, other=0.0)[None, :]
    # round each step to the activation dtype, as the reference's separate torch ops do
    dt = out_ptr.dtype.element_ty
    gate = gate.to(dt).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
    h = (act * up.to(dt).to(tl.float32)).to(dt)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out_ptrs, h, mask=valid[:, None] & (n[None, :] < inter))


@triton.jit(do_not_specialize=["num_pairs", "num_blocks", "group_blocks"])
def _down_kernel(
    h_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_ids_ptr, expert_of_block_ptr, num_padded_ptr,
    h_scale_ptr, w_scale_ptr,
    num_pairs, hidden, inter, num_blocks, group_blocks,
    stride_hm, stride_we, stride_wn, stride_wk, stride_om, stride_hsm, stride_wse, stride_wsn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr, GROUP_K: tl.constexpr, FAST_ACCUM: tl.constexpr,
):  # fmt: skip
    """out[pair, n] = weight[pair] * (h[pair] @ down[e, n]) for one block of pairs. ``FP8``: ``h``
    and ``w`` hold e4m3 values, scaled per pair (``h_scale``) and per expert and row (``w_scale``)
    once the sums are done, or per K step with ``GROUP_K`` as in the gate / up kernel."""
    pid_m, pid_n = _block_and_column(num_blocks, tl.cdiv(hidden, BLOCK_N), group_blocks)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    e = tl.load(expert_of_block_ptr + pid_m).to(tl.int64)
    valid = rows < num_pairs
    rows64 = rows.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows64[:, None] * stride_hm + k[None, :]
    w_ptrs = w_ptr + e * stride_we + n[None, :] * stride_wn + k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        a = tl.load(h_ptrs, mask=valid[:, None] & (k[None, :] < inter - k0), other=0.0)
        w = tl.load(w_ptrs, mask=(n[None, :] < hidden) & (k[:, None] < inter - k0), other=0.0)
        if FP8 and GROUP_K:
            group = k0 // GROUP_K
            h_s = tl.load(h_scale_ptr + rows64 * stride_hsm + group, mask=valid, other=0.0)
            w_s = tl.load(w_scale_ptr + e * stride_wse + n * stride_wsn + group, mask=n < hidden, other=0.0)
            acc += tl.dot(a, w) * h_s[:, None] * w_s[None, :]
        elif FP8 and not FAST_ACCUM:  # each step summed apart, as in the gate / up kernel
            acc += tl.dot(a, w)
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if FP8 and not GROUP_K:
        h_s = tl.load(h_scale_ptr + rows64 * stride_hsm, mask=valid, other=0.0)
        w_s = tl.load(w_scale_ptr + e * stride_wse + n * stride_wsn, mask=n < hidden, other=0.0)
        acc = acc * h_s[:, None] * w_s[None, :]
    dt = out_ptr.dtype.element_ty
    weight = tl.load(topk_weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    out = (acc.to(dt).to(tl.float32) * weight[:, None]).to(dt)
    out_ptrs = out_ptr + rows64[:, None] * stride_om + n[None, :]
    tl.store(out_ptrs, out, mask=valid[:, None] & (n[None, :] < hidden))


@triton.jit
def _sum_over_k_kernel(pairs_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[token] = the token's ``TOP_K`` rows of ``pairs`` summed in fp32 in k order, rounded once."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (token * TOP_K + k) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Prompt steps of Qwen3-30B-A3B's experts on an H100 (`bench_fused_moe.py --config`), all blocks
# against 8: 16,384 tokens 3478 -> 2873 us (16-bit), 2287 -> 1940 (e4m3); 4,096 tokens 1080 -> 893,
# 721 -> 656; 2 to 32 within 9% of each other; decode sizes (256-1,024 tokens) unchanged or 1-7% faster
GROUP_BLOCKS = 8


def fused_moe_config(
    num_pairs: int, num_experts: int, dtype: torch.dtype, block_scales: bool = False
) -> dict:
    """Tiles, from sweeps at Qwen3-30B-A3B's shape (16-bit on the H200, e4m3 on the H100:
    ``benchmarks/bench_fused_moe.py --sweep``): BLOCK_M follows the pairs an expert gets on
    average (padding is wasted work); fp32 keeps to smaller tiles so the staged ones fit in shared
    memory. ``dtype``: the GEMM operands'. e4m3 K steps of 256 features (block scales cap them at
    128) stream the weights 3-4% faster at decode; in prompt steps, where the products count,
    128-feature steps run 1.15-1.2x the 64-feature ones. ``block_scales``: e4m3 experts scaled by
    128 x 128 blocks (an FP8 checkpoint's)."""
    per_expert = num_pairs / num_experts
    if dtype == torch.float32:
        block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
        return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)
    if dtype == FP8:
        if per_expert <= 48:  # a K step of block scales stays inside one group
            block_m, block_k = 16 if per_expert <= 16 else 32, GROUP if block_scales else 256
            return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=3)
        if per_expert <= 96:
            return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
        block_n = 64 if per_expert <= 256 else 128
        return dict(BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=128, num_warps=8, num_stages=3)
    if per_expert <= 48:  # bound by reading the experts' weights: long K tiles
        block_m = 16 if per_expert <= 8 else 32
        return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if per_expert <= 96:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict | None = None,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`fused_moe_ref` (same arguments and semantics), without host syncs;
    ``topk_ids`` must lie in ``[0, experts)`` (unchecked: checking would sync with the host).
    ``config`` overrides the tiles: ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K`` (powers of two >= 16;
    ``BLOCK_K`` >= 32 for e4m3 weights), ``num_warps``, ``num_stages``, and ``FAST_ACCUM`` (e4m3
    experts with per-row scales: sums kept in the tensor cores' accumulator; default on), and
    ``GROUP_BLOCKS`` (blocks of pairs whose column tiles run together, so that their rows are
    read from DRAM once rather than once per column tile; default :data:`GROUP_BLOCKS`; 0: all
    blocks, one column tile of each before the next column). With e4m3 weights each GEMM's input
    is quantized by :func:`~nanovllm.kernels.fp8.quantize_per_token_group` first, and on CUDA it
    needs float8 tensor cores (compute capability 8.9+)."""
    fp8, grouped = _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    if x.stride(1) != 1:
        raise ValueError("x needs a unit stride in the last dimension")
    if fp8 and (w13_scale.stride(-1) != 1 or w2_scale.stride(-1) != 1):
        raise ValueError("w13_scale and w2_scale need a unit stride in the last dimension")
    if fp8 and x.is_cuda and capability(x.device) < (8, 9):
        raise ValueError("e4m3 experts need float8 tensor cores (compute capability 8.9+)")
    tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    cfg = fused_moe_config(num_pairs, num_experts, w13.dtype, grouped) | (config or {})
    tiles = {key: cfg[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    if fp8 and tiles["BLOCK_K"] < 32:  # the fp8 MMA's K is 32
        raise ValueError(f"BLOCK_K must be at least 32 for e4m3 weights: {tiles['BLOCK_K']}")
    if grouped and tiles["BLOCK_K"] > GROUP:  # a K step scaled by one group's scales
        raise ValueError(f"BLOCK_K must be at most {GROUP} for block-scaled weights: {tiles['BLOCK_K']}")
    launch = dict(
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        FP8=fp8,
        GROUP_K=GROUP if grouped else 0,
        FAST_ACCUM=fp8 and not grouped and bool(cfg.get("FAST_ACCUM", True)),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **tiles,
    )
    sorted_ids, expert_of_block, num_padded = moe_align(topk_ids, num_experts, tiles["BLOCK_M"])
    weights = topk_weights.reshape(-1).contiguous()
    num_blocks = expert_of_block.numel()
    # e4m3: each token's hidden state rounded once, whichever experts read it; without, the scale
    # pointers are never read (any tensor stands in)
    a, a_scale = quantize_per_token_group(x, group=GROUP if grouped else hidden) if fp8 else (x, x)
    w13_s = w13_scale if fp8 else x
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    group_blocks = cfg.get("GROUP_BLOCKS", GROUP_BLOCKS) or num_blocks
    _gate_up_kernel[(num_blocks * triton.cdiv(inter, tiles["BLOCK_N"]),)](
        a, w13, h, sorted_ids, expert_of_block, num_padded, a_scale, w13_s,
        num_pairs, top_k, hidden, inter, num_blocks, group_blocks,
        a.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), h.stride(0),
        a_scale.stride(0), w13_s.stride(0), w13_s.stride(1),
        **launch,
    )  # fmt: skip
    h, h_scale = quantize_per_token_group(h, group=GROUP if grouped else inter) if fp8 else (h, h)
    w2_s = w2_scale if fp8 else x
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(num_blocks * triton.cdiv(hidden, tiles["BLOCK_N"]),)](
        h, w2, out, weights, sorted_ids, expert_of_block, num_padded, h_scale, w2_s,
        num_pairs, hidden, inter, num_blocks, group_blocks,
        h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out.stride(0),
        h_scale.stride(0), w2_s.stride(0), w2_s.stride(1),
        **launch,
    )  # fmt: skip
    # fixed-order fp32 sum over k (deterministic, unlike atomics), rounded once like the reference
    if top_k == 1:
        return out
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_over_k_kernel[(tokens, triton.cdiv(hidden, block))](out, summed, hidden, TOP_K=top_k, BLOCK=block)
    return summed
