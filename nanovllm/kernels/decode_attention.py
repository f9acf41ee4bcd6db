"""Paged decode attention: one query token per sequence against its cached context."""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention_common import (
    LOG2E,
    MASK_CONTEXT_END,
    attend_tile,
    check_inputs,
    dot_precision,
    fp16_query,
    kv_head_bases,
    output_for,
    reads_in_fp16,
)
from nanovllm.kernels.decode_reduce import combine_splits
from nanovllm.kernels.device import num_sms, pdl_options, wait_for_prior_grid
from nanovllm.kernels.kv_layout import KVLayout
from nanovllm.kernels.qk_norm_rope_store import (
    check_prologue_inputs,
    norm_rope_halves,
    qk_norm_rope_store,
    rotary_at,
    store_new_kv,
)

_MIN_ROWS = 16  # tl.dot needs M >= 16: the GQA group is padded up to this
_SPLIT_ALIGN = 16  # split lengths are rounded up to this many tokens
# Tiles measured on H200 (bf16, head_dim 128), many layers per graph as in a decode step. One
# split (a large batch): 64-token tiles, 2 stages, so several programs share an SM and one's
# start-up hides under another's streaming (3 stages, at launch or pipelining the tile loop
# with tl.range, won at uniform contexts and lost end to end on the bench's varied ones).
# Several splits (few, short programs): 32-token tiles cut every step's latency.
# A float8 cache (its V token-major) computes in fp16 and reads 16 KB tiles (128 tokens) at one
# split and at few, 8 KB at more: with splits, 1.1-1.3x faster than 32-token tiles (H200 sweep).
_FINAL_TILE_BYTES, _FINAL_STAGES = 16 * 1024, 2
_SPLIT_BLOCK_N, _SPLIT_STAGES = 32, 2
_NUM_WARPS = 4
# Few splits mean long spans per program: two warps keep more of them resident (H200 sweep).
_FEW_SPLITS, _FEW_SPLITS_WARPS = 4, 2
_MIN_SPLIT_TOKENS = 64  # default splits never cut a full block table finer than this
_PROGRAMS_PER_SM = 4  # default split count aims at this many programs per SM
# From this many splits (short programs, bound by latency) the q/k prologue runs inside the
# split kernel, one launch a layer fewer (H100: the 8B's 1- and 16-row steps 2.1% and 1.3%
# shorter, the 0.6B's 6% and 4.6%); with fewer, longer programs its work repeated in each
# costs more than its own kernel (measured slower at 1-2 splits).
_MIN_SPLITS_FOR_PROLOGUE = _FEW_SPLITS + 1


class DecodePrologue(NamedTuple):
    """What :func:`paged_decode_attention` does to q, k and v before it attends, as
    :func:`~nanovllm.kernels.qk_norm_rope_store.qk_norm_rope_store` does (the same arguments
    but q and the caches): q and k normed and rotated, k and v stored at ``slot_mapping``."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float
    slot_mapping: torch.Tensor


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-torch reference.

    q: ``[batch, num_heads, head_dim]``; k_cache/v_cache: ``[num_blocks, block_size,
    num_kv_heads, head_dim]``; block_tables: ``[batch, max_blocks]`` int32 (entries past a
    sequence's last block are ignored); context_lens: ``[batch]`` int32, >= 1, the number of
    cached tokens including the current one. Returns ``[batch, num_heads, head_dim]``.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for b, ctx in enumerate(context_lens.tolist()):
        blocks = block_tables[b, : (ctx + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        qb = q[b].float().view(num_kv_heads, group, head_dim)
        scores = torch.einsum("hgd,thd->hgt", qb, k) * scale
        probs = scores.softmax(dim=-1)
        out[b] = torch.einsum("hgt,thd->hgd", probs, v).reshape(num_heads, head_dim).to(q.dtype)
    return out


# sizes that vary step to step are not specialised on, so they trigger no recompilation
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, order_ptr, out_ptr, lse_ptr,
    qk_scale, num_splits, stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, stride_bt,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_ALIGN: tl.constexpr, FINAL: tl.constexpr, HAS_ORDER: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr, DOT_PRECISION: tl.constexpr, F16_DOT: tl.constexpr,
    new_k_ptr, new_v_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, slot_mapping_ptr,
    eps, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_cs,
    PROLOGUE: tl.constexpr, HAS_NORM: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    V_LARGEST: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One program: all GROUP query heads of one KV head over one split of one sequence.

    With PROLOGUE, q is normed and rotated as it is loaded (the ``new_*``, ``positions``,
    ``cos_sin``, weights and ``slot_mapping`` arguments as :class:`DecodePrologue` has them),
    and the program whose split holds the row's new token norms, rotates and stores that
    token's K and V first (a barrier between: its own tiles read them back).

    With FINAL (a single split) it writes the output; otherwise the normalised partial output
    to ``out[seq, head, split]`` (fp32) and its base-2 log-sum-exp to ``lse[seq, head, split]``.
    A token-major V (V_TOKEN_MAJOR) is read by whole tiles inside one cache block, slots past
    the context included: :func:`launch_settings` makes SPLIT_ALIGN a multiple of BLOCK_N and
    BLOCK_N a divisor of BLOCK_SIZE.
    """
    wait_for_prior_grid(PDL)
    split, kv_head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if HAS_ORDER:  # programs start in launch order; this one takes the row named here
        ordered = tl.load(order_ptr + seq)
        seq = tl.where(ordered >= 0, ordered, seq)
    ctx = tl.load(context_lens_ptr + seq)
    # Splits are cut per sequence from its real length; trailing ones may be empty.
    split_len = tl.cdiv(tl.cdiv(ctx, num_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    k_base, v_base = kv_head_bases(
        k_cache_ptr, v_cache_ptr, kv_head, offs_d, stride_kh, stride_vh, stride_vd, V_TOKEN_MAJOR
    )
    if PROLOGUE:
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_h = tl.arange(0, HALF)[None, :]
        cos, sin = rotary_at(cos_sin_ptr, tl.load(positions_ptr + seq).to(tl.int64), stride_cs, HALF)
        q_row = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_h
        q1 = tl.load(q_row, mask=g_mask[:, None], other=0.0)
        q2 = tl.load(q_row + HALF, mask=g_mask[:, None], other=0.0)
        q1, q2 = norm_rope_halves(q1, q2, q_weight_ptr, cos, sin, eps, HAS_NORM, HALF)
        q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_G, HEAD_DIM))
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        if (slot >= 0) & (start < ctx) & (ctx <= end):  # this split ends with the new token
            k_row = new_k_ptr + seq * stride_nkt + kv_head * stride_nkh + offs_h
            k1, k2 = norm_rope_halves(
                tl.load(k_row), tl.load(k_row + HALF), k_weight_ptr, cos, sin, eps, HAS_NORM, HALF
            )
            v_row = new_v_ptr + seq * stride_nvt + kv_head * stride_nvh
            store_new_kv(
                k_cache_ptr, v_cache_ptr, k1, k2, v_row, slot, kv_head, offs_h < HALF,
                stride_vb, stride_vh, stride_vd, NUM_KV_HEADS, HALF, BLOCK_SIZE, V_TOKEN_MAJOR, V_LARGEST,
            )  # fmt: skip
        tl.debug_barrier()
    else:
        q_offs = seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr + q_offs, mask=g_mask[:, None], other=0.0)
    if F16_DOT:
        q = fp16_query(q)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for tile in range(start, end, BLOCK_N):
        # pos is unread under MASK_CONTEXT_END; a token-major V's splits start on whole tiles
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_base, v_base, bt_row, tile, end, end, qk_scale, stride_kb, stride_kt,
            stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N, MASK_CONTEXT_END, V_TOKEN_MAJOR, V_TOKEN_MAJOR,
            DOT_PRECISION,
        )  # fmt: skip

    # An empty split has l_i == 0: write zeros and lse = -inf so the reduce gives it no weight.
    nonempty = l_i > 0
    acc = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if FINAL:
        out_offs = seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # out is contiguous [batch, num_heads, num_splits, HEAD_DIM] and lse the same without
        # HEAD_DIM, so a row's lse index is its out offset / HEAD_DIM.
        row_offs = seq * stride_ob + heads * stride_oh + split * HEAD_DIM
        tl.store(out_ptr + row_offs[:, None] + offs_d[None, :], acc, mask=g_mask[:, None])
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row_offs // HEAD_DIM, lse, mask=g_mask)


class DecodeLaunch(NamedTuple):
    """How :func:`paged_decode_attention` launches its split kernel."""

    block_n: int  # tokens per KV tile
    split_align: int  # split lengths are multiples of this
    num_stages: int
    num_warps: int
    f16_dot: bool  # computes in fp16 (:func:`~nanovllm.kernels.attention_common.reads_in_fp16`)


def default_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int, num_sms: int) -> int:
    """Splits per (sequence, KV head) so the grid has ~_PROGRAMS_PER_SM programs per SM.

    Depends on static shapes only (CUDA-graph safe); capped so that a sequence filling the
    whole block table (``max_blocks * block_size`` tokens) still gives every split at least
    _MIN_SPLIT_TOKENS tokens. Splits may end mid-block: tokens are gathered one by one.
    """
    wanted = triton.cdiv(_PROGRAMS_PER_SM * num_sms, batch * num_kv_heads)
    cap = triton.cdiv(max_blocks * block_size, _MIN_SPLIT_TOKENS)
    return max(1, min(wanted, cap))


def launch_settings(
    num_splits: int,
    head_dim: int,
    cache_element_size: int,
    q_dtype: torch.dtype,
    layout: KVLayout,
    block_size: int,
) -> DecodeLaunch:
    """The launch with ``num_splits`` splits over a cache of ``layout`` with ``block_size``-token
    blocks: a token-major V's tiles lie inside one block, and its splits start on whole tiles."""
    token_major = layout.v_token_major
    f16_dot = reads_in_fp16(cache_element_size, q_dtype)
    if num_splits == 1:
        block_n = min(128, _FINAL_TILE_BYTES // (head_dim * cache_element_size))
        stages, num_warps = _FINAL_STAGES, _NUM_WARPS
    else:
        few = num_splits <= _FEW_SPLITS
        block_n, stages = _SPLIT_BLOCK_N, _SPLIT_STAGES
        if token_major:  # an 8-bit V
            block_n = _FINAL_TILE_BYTES // (head_dim * cache_element_size) if few else 2 * _SPLIT_BLOCK_N
        num_warps = _FEW_SPLITS_WARPS if few else _NUM_WARPS
        f16_dot = f16_dot and token_major
    split_align = _SPLIT_ALIGN
    if token_major:
        block_n = min(block_n, block_size)
        split_align = max(split_align, block_n)
    return DecodeLaunch(block_n, split_align, stages, num_warps, f16_dot)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    row_order: torch.Tensor | None = None,
    *,
    layout: KVLayout = KVLayout.DIM_MAJOR,
    prologue: DecodePrologue | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton flash-decoding version of :func:`paged_decode_attention_ref` (same semantics)
    over caches laid out as ``layout``; ``row_order`` (int32 ``[batch]``, optional) names the
    rows in the order their programs start, e.g. longest context first (-1: the row's own
    index). With ``prologue``, q is the projection's raw q, and the prologue's work is done
    first (inside the split kernel where it has many splits, else by its own kernel). With
    ``out`` (q's shape and dtype, e.g. rows of a larger output) the result is written there.

    Each program reads a KV tile once for all query heads of its GQA group. The context is
    cut into ``num_splits`` pieces (default :func:`default_num_splits`) combined by a second
    kernel. No host syncs; the grid depends only on shapes, so it is CUDA-graph safe. Inputs
    as :func:`~nanovllm.kernels.attention_common.check_inputs` takes them.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_inputs(q, k_cache, v_cache, layout)
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = default_num_splits(
            batch, num_kv_heads, block_tables.shape[1], block_size, num_sms(q.device)
        )
    elif num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = output_for(q, out)
    if batch == 0:
        return out
    p = prologue
    if p is not None:
        check_prologue_inputs(q, p.k, p.v, p.cos_sin_cache, p.q_weight, p.k_weight, k_cache, v_cache, layout)
        if num_splits < _MIN_SPLITS_FOR_PROLOGUE:
            rotary = (p.positions, p.cos_sin_cache, p.q_weight, p.k_weight, p.eps)
            q, _ = qk_norm_rope_store(q, p.k, p.v, *rotary, k_cache, v_cache, p.slot_mapping, layout=layout)
            p = None
    # without a prologue its pointers are any tensor's: unread
    k_new, v_new = (p.k, p.v) if p else (q, q)
    has_norm = p is not None and p.q_weight is not None
    if num_splits == 1:
        part, lse = out, out  # lse is unused when the kernel writes the final output
    else:
        part = torch.empty(batch, num_heads, num_splits, head_dim, device=q.device)
        lse = torch.empty(batch, num_heads, num_splits, device=q.device)
    launch = launch_settings(num_splits, head_dim, k_cache.element_size(), q.dtype, layout, block_size)
    _decode_split_kernel[(num_splits, num_kv_heads, batch)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        row_order if row_order is not None else context_lens,
        part,
        lse,
        scale * LOG2E,
        num_splits,
        *q.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride(),
        block_tables.stride(0),
        *part.stride()[:2],
        GROUP=group,
        BLOCK_G=max(_MIN_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=launch.block_n,
        SPLIT_ALIGN=launch.split_align,
        FINAL=num_splits == 1,
        HAS_ORDER=row_order is not None,
        V_TOKEN_MAJOR=layout.v_token_major,
        DOT_PRECISION=dot_precision(q.dtype),
        F16_DOT=launch.f16_dot,
        new_k_ptr=k_new,
        new_v_ptr=v_new,
        positions_ptr=p.positions if p else q,
        cos_sin_ptr=p.cos_sin_cache if p else q,
        q_weight_ptr=p.q_weight if has_norm else q,
        k_weight_ptr=p.k_weight if has_norm else q,
        slot_mapping_ptr=p.slot_mapping if p else q,
        eps=p.eps if p else 0.0,
        stride_nkt=k_new.stride(0),
        stride_nkh=k_new.stride(1),
        stride_nvt=v_new.stride(0),
        stride_nvh=v_new.stride(1),
        stride_cs=p.cos_sin_cache.stride(0) if p else 0,
        PROLOGUE=p is not None,
        HAS_NORM=has_norm,
        NUM_KV_HEADS=num_kv_heads,
        V_LARGEST=torch.finfo(v_cache.dtype).max,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **pdl_options(q.device),
    )
    if num_splits > 1:
        combine_splits(part, lse, out)
    return out
