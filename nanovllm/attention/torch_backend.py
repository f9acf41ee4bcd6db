"""Plain-torch attention: the CPU path and the reference the kernels are tested against."""

import torch

from nanovllm.attention.backend import AttentionBackend, AttentionMetadata
from nanovllm.kernels.decode_attention import paged_decode_attention_ref
from nanovllm.kernels.prefill_attention import paged_prefill_attention_ref
from nanovllm.kernels.qk_norm_rope_store import qk_norm_rope_store_ref


class TorchBackend(AttentionBackend):
    name = "torch"
    qk_prologue = staticmethod(qk_norm_rope_store_ref)
    supports_cuda_graphs = False  # the reference loops over sequences on the host

    def prefill(
        self, q, k, v, k_cache, v_cache, layout, meta: AttentionMetadata, scale: float, out=None
    ) -> torch.Tensor:
        result = paged_prefill_attention_ref(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, scale
        )
        return self.written_to(out, result)

    def decode(
        self, q, k_cache, v_cache, layout, meta: AttentionMetadata, scale: float, out=None
    ) -> torch.Tensor:
        result = paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        return self.written_to(out, result)
