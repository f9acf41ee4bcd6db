"""The attention layer: prepares q/k and stores this step's K/V in the paged cache, then attends."""

import torch
from torch import nn

from nanovllm.attention import AttentionBackend, AttentionMetadata, QKTransform


class Attention(nn.Module):
    """Paged attention over one layer's cache; ``k_cache``/``v_cache`` are set by the runner."""

    def __init__(
        self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, backend: AttentionBackend
    ):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = (
            num_heads,
            head_dim,
            scale,
            num_kv_heads,
        )
        self.backend = backend
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        transform: QKTransform,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: ``[tokens, heads, head_dim]``; k, v: ``[tokens, kv_heads, head_dim]``, before
        ``transform`` (q and k may be rewritten in place)."""
        backend = self.backend
        q, k = backend.prepare(q, k, v, self.k_cache, self.v_cache, meta.slot_mapping, transform)
        if not meta.is_prefill:
            return backend.decode(q, self.k_cache, self.v_cache, meta, self.scale)
        d = meta.num_decode_tokens
        if not d:
            return backend.prefill(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        decoded = backend.decode(q[:d], self.k_cache, self.v_cache, meta.decode, self.scale)
        prefilled = backend.prefill(q[d:], k[d:], v[d:], self.k_cache, self.v_cache, meta, self.scale)
        return torch.cat((decoded, prefilled))
