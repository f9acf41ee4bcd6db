"""Between the qkv projection and attention, in one kernel: per-head RMSNorm of q and k
(Qwen3's q_norm/k_norm, optional), the rotary embedding (rotate-half layout), and the store
of this step's k and v into the paged KV cache (layouts as in :mod:`kv_layout`). Decode
attention does the same work inside its own kernel at small batches through this module's
``@triton.jit`` helpers (:func:`norm_rope_halves`, :func:`store_new_kv`), so both round alike."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import pdl_options, wait_for_prior_grid
from nanovllm.kernels.kv_layout import KVLayout


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    layout: KVLayout = KVLayout.DIM_MAJOR,
) -> None:
    """Plain-torch reference of the store: the cache entry of ``slot`` becomes the token's
    key/value for every slot >= 0, cast to the cache's dtype; into float8, values past its
    largest saturate (as the kernel's cast does; torch's own cast gives NaN on CUDA). A
    token-major V is kept finite (:mod:`kv_layout`)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for cache, new in ((k_cache, key), (v_cache, value)):
        new = new[valid]
        largest = torch.finfo(cache.dtype).max
        if cache is v_cache and layout.v_token_major:
            new = new.float().nan_to_num(0.0).clamp(-largest, largest)
        if cache.element_size() == 1:  # float8: copied as bytes (no float8 index_put_ on CPU)
            new = new.float().clamp(-largest, largest).to(cache.dtype).view(torch.uint8)
            cache = cache.view(torch.uint8)
        cache[blocks, offsets] = new.to(cache.dtype)


def _norm_rope_ref(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    dtype = x.dtype
    if weight is not None:  # rounded as the model's RMSNorm rounds: to dtype, times weight
        xf = x.float()
        x = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(dtype) * weight
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


def qk_norm_rope_store_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    layout: KVLayout = KVLayout.DIM_MAJOR,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference. q: ``[tokens, heads, head_dim]``; k, v: ``[tokens, kv_heads,
    head_dim]``; cos_sin_cache: ``[max_position, head_dim]`` fp32, cos then sin; weights
    ``[head_dim]`` or None (no norm). Returns the new q and k (v is unchanged) and stores k and
    v at every slot >= 0 (:func:`store_kvcache_ref`) of caches laid out as ``layout``."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    q, k = _norm_rope_ref(q, q_weight, eps, cos, sin), _norm_rope_ref(k, k_weight, eps, cos, sin)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping, layout=layout)
    return q, k


@triton.jit
def norm_rope_halves(x1, x2, w_ptr, cos, sin, eps, HAS_NORM: tl.constexpr, HALF: tl.constexpr):
    """``[heads, HALF]`` halves of heads, normed (when HAS_NORM, weights at ``w_ptr``) and
    rotated, rounded where the reference rounds; returns the two new halves."""
    offs = tl.arange(0, HALF)[None, :]
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + offs).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs).to(tl.float32)
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def _norm_rope_in_place(row, mask, w_ptr, cos, sin, eps, HAS_NORM: tl.constexpr, HALF: tl.constexpr):
    """:func:`norm_rope_halves` of the ``[heads, HALF]`` halves at ``row`` and ``row + HALF``,
    stored back there; returns them."""
    x1, x2 = tl.load(row, mask=mask, other=0.0), tl.load(row + HALF, mask=mask, other=0.0)
    x1, x2 = norm_rope_halves(x1, x2, w_ptr, cos, sin, eps, HAS_NORM, HALF)
    tl.store(row, x1, mask=mask)
    tl.store(row + HALF, x2, mask=mask)
    return x1, x2


@triton.jit
def rotary_at(cos_sin_ptr, pos, stride_cs, HALF: tl.constexpr):
    """cos and sin (``[1, HALF]`` fp32) of position ``pos``."""
    offs = tl.arange(0, HALF)[None, :]
    return tl.load(cos_sin_ptr + pos * stride_cs + offs), tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs)


@triton.jit
def store_new_kv(
    k_cache_ptr, v_cache_ptr, k1, k2, v_row, slot, hk, mask,
    stride_vcb, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr, V_LARGEST: tl.constexpr,
):  # fmt: skip
    """Store one token's K heads ``hk`` (``[heads, 1]``; halves k1, k2) and its V (halves at
    ``v_row`` and ``v_row + HALF``) at cache slot ``slot`` (int64, >= 0), cast to the caches'
    dtypes. The K cache and a dim-major V cache are contiguous; a token-major V's strides are
    (block, head, dim) and it holds finite values only (see kv_layout)."""
    offs = tl.arange(0, HALF)[None, :]
    # int64 slot: the flat cache index can exceed 2**31 elements
    cache = slot * (NUM_KV_HEADS * 2 * HALF) + hk * (2 * HALF) + offs
    tl.store(k_cache_ptr + cache, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(k_cache_ptr + cache + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v1 = tl.load(v_row + offs, mask=mask)
    v2 = tl.load(v_row + HALF + offs, mask=mask)
    if V_TOKEN_MAJOR:
        v1 = tl.clamp(tl.where(v1 == v1, v1.to(tl.float32), 0.0), -V_LARGEST, V_LARGEST)
        v2 = tl.clamp(tl.where(v2 == v2, v2.to(tl.float32), 0.0), -V_LARGEST, V_LARGEST)
        cache = (slot // BLOCK_SIZE) * stride_vcb + slot % BLOCK_SIZE
        cache += hk * stride_vch + offs * stride_vcd
        half = HALF * stride_vcd
    else:
        half = HALF
    tl.store(v_cache_ptr + cache, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache + half, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_store_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_vcb,
    stride_vch,
    stride_vcd,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    V_TOKEN_MAJOR: tl.constexpr,
    V_LARGEST: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per token: all its q heads and kv heads. The V cache's strides (block,
    head, dim) are read only when it is token-major."""
    wait_for_prior_grid(PDL)
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, HALF)[None, :]
    cos, sin = rotary_at(cos_sin_ptr, pos, stride_cs, HALF)
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    q_row = q_ptr + token * stride_qt + hq * stride_qh + offs
    _norm_rope_in_place(q_row, hq < NUM_HEADS, q_weight_ptr, cos, sin, eps, HAS_NORM, HALF)
    hk = tl.arange(0, BLOCK_HK)[:, None]
    k_mask = hk < NUM_KV_HEADS
    k_row = k_ptr + token * stride_kt + hk * stride_kh + offs
    k1, k2 = _norm_rope_in_place(k_row, k_mask, k_weight_ptr, cos, sin, eps, HAS_NORM, HALF)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        v_row = v_ptr + token * stride_vt + hk * stride_vh
        store_new_kv(
            k_cache_ptr, v_cache_ptr, k1, k2, v_row, slot, hk, k_mask, stride_vcb, stride_vch, stride_vcd,
            NUM_KV_HEADS, HALF, BLOCK_SIZE, V_TOKEN_MAJOR, V_LARGEST,
        )  # fmt: skip


def check_prologue_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: KVLayout,
) -> None:
    """``ValueError`` unless the kernels that norm, rotate and store q/k/v (this module's, and
    decode attention's prologue) take these inputs."""
    head_dim = q.shape[-1]
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need a unit stride in the last dimension")
    layout.check(v_cache)
    if not (k_cache.is_contiguous() and cos_sin_cache.is_contiguous()):
        raise ValueError("k_cache and cos_sin_cache must be contiguous")
    if not (layout.v_token_major or v_cache.is_contiguous()):
        raise ValueError("a dim-major v_cache must be contiguous")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight go together")


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    layout: KVLayout = KVLayout.DIM_MAJOR,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`qk_norm_rope_store_ref` (same arguments); q and k are
    rewritten in place (they may be views into a fused qkv projection, ``stride(-1) == 1``) and
    returned."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    check_prologue_inputs(q, k, v, cos_sin_cache, q_weight, k_weight, k_cache, v_cache, layout)
    if num_tokens == 0:
        return q, k
    has_norm = q_weight is not None
    _qk_norm_rope_store_kernel[(num_tokens,)](
        q,
        k,
        v,
        positions,
        cos_sin_cache,
        q_weight if has_norm else cos_sin_cache,  # any pointer: unread without a norm
        k_weight if has_norm else cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        v_cache.stride(0),
        v_cache.stride(2),
        v_cache.stride(3),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2,
        HAS_NORM=has_norm,
        BLOCK_SIZE=k_cache.shape[1],
        V_TOKEN_MAJOR=layout.v_token_major,
        V_LARGEST=torch.finfo(v_cache.dtype).max,
        **pdl_options(q.device),
    )
    return q, k
