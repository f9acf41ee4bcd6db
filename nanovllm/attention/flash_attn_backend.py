"""FlashAttention (the optional flash-attn package), as nano-vllm uses it."""

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from nanovllm.attention.backend import AttentionBackend, AttentionMetadata
from nanovllm.kernels.qk_norm_rope_store import qk_norm_rope_store


class FlashAttnBackend(AttentionBackend):
    """flash-attn reads dim-major caches only, the one layout the config lets this backend
    have (it keeps 8-bit caches, whose V is token-major, off it)."""

    name = "flash_attn"
    qk_prologue = staticmethod(qk_norm_rope_store)

    def prefill(
        self, q, k, v, k_cache, v_cache, layout, meta: AttentionMetadata, scale: float, out=None
    ) -> torch.Tensor:
        if meta.has_prefix:  # read the cached prefix (and the new tokens) from the paged cache
            k, v, block_table = k_cache, v_cache, meta.block_tables
        else:
            block_table = None
        result = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=block_table,
        )
        return self.written_to(out, result)

    def decode(
        self, q, k_cache, v_cache, layout, meta: AttentionMetadata, scale: float, out=None
    ) -> torch.Tensor:
        result = flash_attn_with_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=meta.context_lens,
            block_table=meta.block_tables,
            softmax_scale=scale,
            causal=True,
        )
        return self.written_to(out, result.squeeze(1))
