"""Paged prefill attention: new query tokens against a cached prefix plus themselves, causal."""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.attention_common import (
    LOG2E,
    MASK_CAUSAL,
    MASK_NONE,
    attend_tile,
    check_inputs,
    dot_precision,
    fp16_query,
    kv_head_bases,
    output_for,
    reads_in_fp16,
)
from nanovllm.kernels.kv_layout import KVLayout

# Tiles measured on H200 (bf16, head_dim 128): 128 (token, head) rows per program against
# 64-key tiles, 4 warps, 3 stages; 4-byte activations (fp32 tests) halve both so that the
# q tile, the accumulator and the stages still fit.
_TILE_BYTES_M, _TILE_BYTES_N = 128 * 128 * 2, 64 * 128 * 2
_MAX_BLOCK_M, _MAX_BLOCK_N = 128, 64
_NUM_WARPS = 4


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-torch reference.

    q: ``[total_q, num_heads, head_dim]``, the new tokens of all sequences packed;
    cu_seqlens_q: ``[batch + 1]`` int32 offsets into q; context_lens: ``[batch]`` int32, the
    number of cached tokens of each sequence *after* the new tokens were stored (so the new
    tokens sit at positions ``context_len - q_len ... context_len - 1``). Query at position p
    attends to keys at positions <= p. The new keys/values must already be in the cache.
    Returns ``[total_q, num_heads, head_dim]``.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        blocks = block_tables[b, : (ctx + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        qb = q[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,thd->hgqt", qb, k) * scale
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        o = torch.einsum("hgqt,thd->qhgd", probs, v).reshape(q_len, num_heads, head_dim)
        out[q_start:q_end] = o.to(q.dtype)
    return out


# the block-table width changes with every batch: do not specialise (recompile) on it
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    block_tables_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    F16_DOT: tl.constexpr,
):
    """One program: BLOCK_M rows of one sequence and KV head, a row being (new token, head).

    Rows are the sequence's ``q_len * GROUP`` (token, query head) pairs in token-major order,
    so every KV tile is read once for all query heads of the group.
    """
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    tile_m = tl.num_programs(2) - 1 - tl.program_id(2)  # the longest rows start first
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    row0 = tile_m * BLOCK_M
    if row0 >= q_len * GROUP:
        return
    ctx = tl.load(context_lens_ptr + seq)
    prefix = ctx - q_len

    rows = row0 + tl.arange(0, BLOCK_M)
    r_mask = rows < q_len * GROUP
    tok = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    pos = prefix + tok  # absolute position of each row's token; it sees keys <= pos
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=r_mask[:, None],
        other=0.0,
    )
    if F16_DOT:
        q = fp16_query(q)
    k_base, v_base = kv_head_bases(
        k_cache_ptr, v_cache_ptr, kv_head, offs_d, stride_kh, stride_vh, stride_vd, V_TOKEN_MAJOR
    )
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Keys needed by the last real token of this tile; key 0 is visible to every row.
    kv_end = prefix + tl.minimum((row0 + BLOCK_M - 1) // GROUP, q_len - 1) + 1
    # Whole tiles every row of this program sees need no mask; the rest (the diagonal) do.
    full_end = (prefix + row0 // GROUP + 1) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # tiles start at multiples of BLOCK_N: where it divides BLOCK_SIZE, each lies in one block
    for tile in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_base, v_base, bt_row, tile, kv_end, pos, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N, MASK_NONE,
            BLOCK_SIZE % BLOCK_N == 0, V_TOKEN_MAJOR, DOT_PRECISION,
        )  # fmt: skip
    for tile in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_base, v_base, bt_row, tile, kv_end, pos, qk_scale,
            stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N, MASK_CAUSAL,
            BLOCK_SIZE % BLOCK_N == 0, V_TOKEN_MAJOR, DOT_PRECISION,
        )  # fmt: skip

    acc = acc / l_i[:, None]
    out_offs = q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=r_mask[:, None])


class PrefillLaunch(NamedTuple):
    """How :func:`paged_prefill_attention` launches its kernel."""

    block_m: int  # (token, query head) rows per program
    block_n: int  # keys per KV tile
    num_stages: int
    num_warps: int
    f16_dot: bool  # computes in fp16 (:func:`~nanovllm.kernels.attention_common.reads_in_fp16`)


def launch_settings(
    head_dim: int, cache_element_size: int, q_dtype: torch.dtype, layout: KVLayout, block_size: int
) -> PrefillLaunch:
    """The launch for a ``q_dtype`` query over a cache of ``layout`` with ``block_size``-token
    blocks: a token-major V's tiles lie inside one block."""
    q_bytes = q_dtype.itemsize
    block_m = min(_MAX_BLOCK_M, _TILE_BYTES_M // (head_dim * q_bytes))
    block_n = min(_MAX_BLOCK_N, _TILE_BYTES_N // (head_dim * q_bytes))
    if layout.v_token_major:
        block_n = min(block_n, block_size)
    num_stages = 3 if q_bytes <= 2 else 2
    return PrefillLaunch(block_m, block_n, num_stages, _NUM_WARPS, reads_in_fp16(cache_element_size, q_dtype))


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    *,
    layout: KVLayout = KVLayout.DIM_MAJOR,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`paged_prefill_attention_ref` (same semantics) over caches laid
    out as ``layout``; with ``out`` (q's shape and dtype) the result is written there.

    ``max_seqlen_q`` (host int, >= every q_len) sizes the grid. Each program covers BLOCK_M
    (token, query head) pairs of one KV head, so K/V tiles are shared across the GQA group.
    Inputs as :func:`~nanovllm.kernels.attention_common.check_inputs` takes them.
    """
    total_q, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_inputs(q, k_cache, v_cache, layout)
    group = num_heads // num_kv_heads
    batch = cu_seqlens_q.shape[0] - 1
    out = output_for(q, out)
    if total_q == 0 or batch == 0:
        return out
    launch = launch_settings(head_dim, k_cache.element_size(), q.dtype, layout, block_size)
    grid = (num_kv_heads, batch, triton.cdiv(max_seqlen_q * group, launch.block_m))
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
        context_lens,
        block_tables,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride(),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        V_TOKEN_MAJOR=layout.v_token_major,
        DOT_PRECISION=dot_precision(q.dtype),
        F16_DOT=launch.f16_dot,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )
    return out
