"""Writing new keys/values into the paged KV cache (on the device, fused into
:mod:`qk_norm_rope_store`).

Cache layout (all kernels): ``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's
slot is ``block_id * block_size + offset``; a slot of -1 means "do not store" (padding).
"""

import torch


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch reference: ``k_cache.flat[slot] = key`` for every slot >= 0, cast to the
    cache's dtype; into float8, values past its largest saturate (as the kernel's cast does;
    torch's own cast gives NaN on CUDA)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for cache, new in ((k_cache, key), (v_cache, value)):
        new = new[valid]
        if cache.element_size() == 1:  # float8: copied as bytes (no float8 index_copy_ on CPU)
            largest = torch.finfo(cache.dtype).max
            new = new.float().clamp(-largest, largest).to(cache.dtype).view(torch.uint8)
            cache = cache.view(torch.uint8)
        else:
            new = new.to(cache.dtype)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, new)
