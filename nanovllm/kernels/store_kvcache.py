"""Write new keys/values into the paged KV cache.

Cache layout (all kernels): ``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's
slot is ``block_id * block_size + offset``; a slot of -1 means "do not store" (padding).
"""

import torch
import triton
import triton.language as tl


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch reference: ``k_cache.flat[slot] = key`` for every slot >= 0."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[valid].to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[valid].to(v_cache.dtype))


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    # int64 slot: the flat cache index can exceed 2**31 elements.
    cache_offs = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h * HEAD_DIM + offs_d
    k = tl.load(key_ptr + token * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of :func:`store_kvcache_ref`, one program per token.

    key/value: ``[num_tokens, num_kv_heads, head_dim]``, any strides with ``stride(-1) == 1``
    (e.g. views into a fused qkv projection). k_cache/v_cache must be contiguous.
    slot_mapping: ``[num_tokens]`` int32/int64; tokens with slot -1 are skipped.
    """
    num_tokens = key.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value need a unit stride in the last dimension")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache/v_cache must be contiguous")
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
