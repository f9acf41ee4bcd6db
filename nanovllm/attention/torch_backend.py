"""Plain-torch attention: the CPU path and the reference the kernels are tested against."""

import torch

from nanovllm.attention.backend import AttentionBackend, AttentionMetadata
from nanovllm.kernels.decode_attention import paged_decode_attention_ref
from nanovllm.kernels.prefill_attention import paged_prefill_attention_ref
from nanovllm.kernels.store_kvcache import store_kvcache_ref


class TorchBackend(AttentionBackend):
    name = "torch"
    supports_cuda_graphs = False  # the reference loops over sequences on the host

    def store(self, k, v, k_cache, v_cache, slot_mapping):
        store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_prefill_attention_ref(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, scale
        )

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
