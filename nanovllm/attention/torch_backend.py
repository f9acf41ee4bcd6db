"""Plain-torch attention: the CPU path and the reference the kernels are tested against."""

import torch

from nanovllm.attention.backend import AttentionBackend, AttentionMetadata, QKTransform
from nanovllm.kernels.decode_attention import paged_decode_attention_ref
from nanovllm.kernels.prefill_attention import paged_prefill_attention_ref
from nanovllm.kernels.qk_norm_rope_store import qk_norm_rope_store_ref


class TorchBackend(AttentionBackend):
    name = "torch"
    supports_cuda_graphs = False  # the reference loops over sequences on the host

    def prepare(self, q, k, v, k_cache, v_cache, slot_mapping, t: QKTransform):
        return qk_norm_rope_store_ref(
            q,
            k,
            v,
            t.positions,
            t.cos_sin_cache,
            t.q_norm_weight,
            t.k_norm_weight,
            t.eps,
            k_cache,
            v_cache,
            slot_mapping,
        )

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_prefill_attention_ref(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, scale
        )

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
