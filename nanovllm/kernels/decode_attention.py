"""Paged decode attention: one query token per sequence against its cached context."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.decode_reduce import combine_splits, default_num_splits, num_sms
from nanovllm.kernels.store_kvcache import fp16_query, is_token_major, reads_in_fp16

_LOG2E = 1.4426950408889634
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


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, k_base, v_base, bt_row, tile, end, qk_scale, stride_kb, stride_kt, stride_vb, stride_vt,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, V_TOKEN_MAJOR: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online-softmax update with the tokens ``tile .. tile + BLOCK_N - 1`` before ``end``."""
    toks = tile + tl.arange(0, BLOCK_N)
    t_mask = toks < end
    if V_TOKEN_MAJOR:  # tiles start on multiples of BLOCK_N, which divides BLOCK_SIZE
        blk = tl.load(bt_row + tile // BLOCK_SIZE).to(tl.int64)
        row = tl.multiple_of(tile % BLOCK_SIZE, BLOCK_N) + tl.arange(0, BLOCK_N)
    else:  # masked lanes never touch the table, so padding entries (-1, garbage) are never used
        blk = tl.load(bt_row + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        row = toks % BLOCK_SIZE
    k = tl.load(k_base + (blk * stride_kb + row * stride_kt)[:, None], mask=t_mask[:, None], other=0.0)
    k = k.to(q.dtype)  # a float8 cache holds K/V at scale 1
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_TOKEN_MAJOR:  # v_base spans head_dim down its rows: V^T, tokens contiguous
        # Whole tiles, unmasked (a mask along the tokens would cut the loads to single bytes):
        # the tile lies in one allocated block, and a token-major V holds only finite values,
        # which p == 0 cancels.
        v = tl.trans(tl.load(v_base + blk * stride_vb + row[None, :]).to(q.dtype))
    else:
        v = tl.load(v_base + (blk * stride_vb + row * stride_vt)[:, None], mask=t_mask[:, None], other=0.0)
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


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
):  # fmt: skip
    """One program: all GROUP query heads of one KV head over one split of one sequence.

    With FINAL (a single split) it writes the output; otherwise the normalised partial output
    to ``out[seq, head, split]`` (fp32) and its base-2 log-sum-exp to ``lse[seq, head, split]``.
    A token-major V (V_TOKEN_MAJOR) is read by whole tiles inside one cache block, slots past
    the context included: :func:`launch_settings` makes SPLIT_ALIGN a multiple of BLOCK_N and
    BLOCK_N a divisor of BLOCK_SIZE.
    """
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
    q_offs = seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None], other=0.0)
    if F16_DOT:
        q = fp16_query(q)
    k_base = k_cache_ptr + kv_head * stride_kh + offs_d[None, :]
    if V_TOKEN_MAJOR:
        v_base = v_cache_ptr + kv_head * stride_vh + offs_d[:, None] * stride_vd
    else:
        v_base = v_cache_ptr + kv_head * stride_vh + offs_d[None, :]
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for tile in range(start, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_base, v_base, bt_row, tile, end, qk_scale, stride_kb, stride_kt,
            stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N, V_TOKEN_MAJOR, DOT_PRECISION,
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


def launch_settings(
    num_splits: int,
    head_dim: int,
    cache_element_size: int,
    q_dtype: torch.dtype,
    token_major_block_size: int | None = None,
) -> tuple[int, int, int, int, bool]:
    """(tile tokens, split alignment, stages, warps, fp16 dot) of a launch with ``num_splits``
    splits; for a token-major V, ``token_major_block_size`` is the cache's block size (tiles lie
    inside one, and splits start on whole tiles)."""
    f16_dot = reads_in_fp16(cache_element_size, q_dtype)
    if num_splits == 1:
        block_n = min(128, _FINAL_TILE_BYTES // (head_dim * cache_element_size))
        stages, num_warps = _FINAL_STAGES, _NUM_WARPS
    else:
        few = num_splits <= _FEW_SPLITS
        block_n, stages = _SPLIT_BLOCK_N, _SPLIT_STAGES
        if token_major_block_size is not None:  # an 8-bit V
            block_n = _FINAL_TILE_BYTES // (head_dim * cache_element_size) if few else 2 * _SPLIT_BLOCK_N
        num_warps = _FEW_SPLITS_WARPS if few else _NUM_WARPS
        f16_dot = f16_dot and token_major_block_size is not None
    split_align = _SPLIT_ALIGN
    if token_major_block_size is not None:
        block_n = min(block_n, token_major_block_size)
        split_align = max(split_align, block_n)
    return block_n, split_align, stages, num_warps, f16_dot


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    row_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton flash-decoding version of :func:`paged_decode_attention_ref` (same semantics);
    ``row_order`` (int32 ``[batch]``, optional) names the rows in the order their programs
    start, e.g. longest context first (-1: the row's own index).

    Each program reads a KV tile once for all query heads of its GQA group. The context is
    cut into ``num_splits`` pieces (default :func:`default_num_splits`) combined by a second
    kernel. No host syncs; the grid depends only on shapes, so it is CUDA-graph safe.
    Needs a power-of-two head_dim >= 16, ``stride(-1) == 1`` for q and k_cache, and a
    dim-major or token-major v_cache (:mod:`~nanovllm.kernels.store_kvcache`).
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and k_cache need a unit stride in the last dimension")
    v_token_major = is_token_major(v_cache)
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = default_num_splits(
            batch, num_kv_heads, block_tables.shape[1], block_size, num_sms(q.device)
        )
    elif num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits == 1:
        part, lse = out, out  # lse is unused when the kernel writes the final output
    else:
        part = torch.empty(batch, num_heads, num_splits, head_dim, device=q.device)
        lse = torch.empty(batch, num_heads, num_splits, device=q.device)
    block_n, split_align, num_stages, num_warps, f16_dot = launch_settings(
        num_splits, head_dim, k_cache.element_size(), q.dtype, block_size if v_token_major else None
    )
    _decode_split_kernel[(num_splits, num_kv_heads, batch)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        row_order if row_order is not None else context_lens,
        part,
        lse,
        scale * _LOG2E,
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
        BLOCK_N=block_n,
        SPLIT_ALIGN=split_align,
        FINAL=num_splits == 1,
        HAS_ORDER=row_order is not None,
        V_TOKEN_MAJOR=v_token_major,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        F16_DOT=f16_dot,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        combine_splits(part, lse, out)
    return out
