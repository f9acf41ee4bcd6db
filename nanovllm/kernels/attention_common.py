"""What the paged attention kernels (:mod:`decode_attention`, :mod:`prefill_attention`) share:
the online-softmax step over one KV tile, the checks of their inputs, and when they compute in
fp16 over an 8-bit cache. Layouts as in :mod:`~nanovllm.kernels.kv_layout`."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.kv_layout import KVLayout

LOG2E = 1.4426950408889634  # scores are scaled by it so that the softmax runs on exp2

# Which keys of a tile each row sees (attend_tile's MASK).
MASK_NONE = tl.constexpr(0)  # all: the tile lies before kv_end and before every row's position
MASK_CONTEXT_END = tl.constexpr(1)  # those before kv_end (decode)
MASK_CAUSAL = tl.constexpr(2)  # those at or before the row's position, loaded up to kv_end (prefill)


def reads_in_fp16(cache_element_size: int, q_dtype: torch.dtype) -> bool:
    """Whether attention over a cache with ``cache_element_size``-byte elements computes in
    fp16 under a ``q_dtype`` query: an 8-bit cache under bf16 (e4m3 widens to fp16 in one
    instruction, to bf16 in three)."""
    return cache_element_size == 1 and q_dtype == torch.bfloat16


@triton.jit
def fp16_query(q):
    """``q`` for the fp16 dot of :func:`reads_in_fp16`, clamped to fp16's range."""
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


def dot_precision(q_dtype: torch.dtype) -> str:
    """The kernels' ``input_precision`` for a ``q_dtype`` query: exact products for fp32."""
    return "ieee" if q_dtype == torch.float32 else "tf32"


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: KVLayout) -> None:
    """``ValueError`` unless the kernels take these: a power-of-two head_dim >= 16, whole GQA
    groups, ``stride(-1) == 1`` for q and k_cache, and a v_cache laid out as ``layout``."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if num_heads % k_cache.shape[2]:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and k_cache need a unit stride in the last dimension")
    layout.check(v_cache)


def output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` if given (``ValueError`` unless it has q's shape, dtype and device and a unit
    stride in the last dimension, as the kernels write it), else a new tensor like q."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(
            f"out must be a {tuple(q.shape)} {q.dtype} tensor on {q.device} with a unit last stride, "
            f"not {tuple(out.shape)} {out.dtype} on {out.device} with strides {out.stride()}"
        )
    return out


@triton.jit
def kv_head_bases(
    k_cache_ptr, v_cache_ptr, kv_head, offs_d, stride_kh, stride_vh, stride_vd, V_TOKEN_MAJOR: tl.constexpr
):
    """Where ``kv_head``'s K and V start in their caches, ``offs_d`` spanning head_dim: along
    the columns, or for a token-major V down the rows (V^T, tokens contiguous)."""
    k_base = k_cache_ptr + kv_head * stride_kh + offs_d[None, :]
    if V_TOKEN_MAJOR:
        v_base = v_cache_ptr + kv_head * stride_vh + offs_d[:, None] * stride_vd
    else:
        v_base = v_cache_ptr + kv_head * stride_vh + offs_d[None, :]
    return k_base, v_base


@triton.jit
def attend_tile(
    q, acc, m_i, l_i, k_base, v_base, bt_row, tile, kv_end, pos, qk_scale,
    stride_kb, stride_kt, stride_vb, stride_vt,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, IN_ONE_BLOCK: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of ``(acc, m_i, l_i)`` with the keys ``tile .. tile + BLOCK_N - 1``,
    masked as ``MASK`` says (``pos``: each row's position, read by MASK_CAUSAL only).

    IN_ONE_BLOCK: the tile starts on a multiple of BLOCK_N, which divides BLOCK_SIZE, so it lies
    in one cache block and takes one table entry. A token-major V needs it. ``k_base`` and
    ``v_base`` as :func:`kv_head_bases` gives them.
    """
    keys = tile + tl.arange(0, BLOCK_N)
    # Decode's mask is made before the table lookup, prefill's at its loads: the two orders
    # compile to differently scheduled code, and each kernel keeps the code it was measured with.
    if MASK == MASK_CONTEXT_END:
        in_context = keys < kv_end
    if IN_ONE_BLOCK:
        blk = tl.load(bt_row + tile // BLOCK_SIZE).to(tl.int64)
        row = tl.multiple_of(tile % BLOCK_SIZE, BLOCK_N) + tl.arange(0, BLOCK_N)
    else:  # masked lanes never touch the table, so padding entries (-1, garbage) are never used
        blk = tl.load(bt_row + keys // BLOCK_SIZE, mask=keys < kv_end, other=0).to(tl.int64)
        row = keys % BLOCK_SIZE
    k_ptrs = k_base + (blk * stride_kb + row * stride_kt)[:, None]
    if MASK == MASK_NONE:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=(keys < kv_end)[:, None], other=0.0)
    # a float8 cache holds K/V at scale 1
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    if MASK == MASK_CONTEXT_END:
        s = tl.where(in_context[None, :], s, float("-inf"))
    elif MASK == MASK_CAUSAL:
        s = tl.where(keys[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_TOKEN_MAJOR:
        # Whole tiles, unmasked (a mask along the tokens would cut the loads to single bytes):
        # the tile lies in one allocated block, and a token-major V holds only finite values,
        # which p == 0 cancels.
        v = tl.trans(tl.load(v_base + blk * stride_vb + row[None, :]).to(q.dtype))
    else:
        v_ptrs = v_base + (blk * stride_vb + row * stride_vt)[:, None]
        if MASK == MASK_NONE:
            v = tl.load(v_ptrs).to(q.dtype)
        else:
            v = tl.load(v_ptrs, mask=(keys < kv_end)[:, None], other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
