"""The paged KV cache's layout, and writing new keys/values into it (on the device, fused
into :mod:`qk_norm_rope_store`).

Every kernel sees a layer's caches as ``[num_blocks, block_size, num_kv_heads, head_dim]``; a
token's slot is ``block_id * block_size + offset``; a slot of -1 means "do not store"
(padding). K is stored in that order. V is too, or token-major: ``[num_blocks, num_kv_heads,
head_dim, block_size]`` in memory (:func:`as_token_major`), so that attention's P.V reads its
second operand along the reduction (token) axis. An 8-bit V needs that: shared memory cannot
hand out 8-bit operands transposed, so a dim-major float8 V is read from it a byte at a time.

Attention reads a token-major V by whole tiles, slots past a context included (masking along
the tokens would cut the loads to single elements), and gives those slots zero weight; a NaN
or an infinity there would survive that. So a token-major V holds finite values only: the
store writes a NaN as 0 and clamps to the cache dtype's range (the cache starts zeroed).
"""

import torch
import triton
import triton.language as tl


def reads_in_fp16(cache_element_size: int, q_dtype: torch.dtype) -> bool:
    """Whether attention over a cache with ``cache_element_size``-byte elements computes in
    fp16 under a ``q_dtype`` query: an 8-bit cache under bf16 (e4m3 widens to fp16 in one
    instruction, to bf16 in three)."""
    return cache_element_size == 1 and q_dtype == torch.bfloat16


@triton.jit
def fp16_query(q):
    """``q`` for the fp16 dot of :func:`reads_in_fp16`, clamped to fp16's range."""
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


def v_token_major_for(dtype: torch.dtype) -> bool:
    """Whether the engine stores a V cache of ``dtype`` token-major: when it is 8-bit."""
    return dtype.itemsize == 1


def as_token_major(storage: torch.Tensor) -> torch.Tensor:
    """``storage`` (contiguous, ``[num_blocks, block_size, num_kv_heads, head_dim]`` elements)
    read as a token-major V cache: same shape, ``[blocks, heads, dim, tokens]`` in memory."""
    num_blocks, block_size, num_kv_heads, head_dim = storage.shape
    return storage.view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)


def is_token_major(v_cache: torch.Tensor) -> bool:
    """True for a V cache laid out as :func:`as_token_major` makes it, False for one whose
    head_dim is its unit-stride axis; ``ValueError`` for any other layout."""
    if v_cache.stride(1) == 1 and v_cache.stride(3) == v_cache.shape[1]:
        return True
    if v_cache.stride(3) == 1:
        return False
    raise ValueError("v_cache must be dim-major (unit stride in head_dim) or token-major (as_token_major)")


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch reference: the cache entry of ``slot`` becomes the token's key/value for
    every slot >= 0, cast to the cache's dtype; into float8, values past its largest saturate
    (as the kernel's cast does; torch's own cast gives NaN on CUDA). A token-major V is kept
    finite (module docstring)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for cache, new in ((k_cache, key), (v_cache, value)):
        new = new[valid]
        largest = torch.finfo(cache.dtype).max
        if cache is v_cache and is_token_major(v_cache):
            new = new.float().nan_to_num(0.0).clamp(-largest, largest)
        if cache.element_size() == 1:  # float8: copied as bytes (no float8 index_put_ on CPU)
            new = new.float().clamp(-largest, largest).to(cache.dtype).view(torch.uint8)
            cache = cache.view(torch.uint8)
        cache[blocks, offsets] = new.to(cache.dtype)
