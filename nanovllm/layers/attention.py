"""The attention layer: prepares q/k and stores this step's K/V in the paged cache, then attends."""

import torch
from torch import nn

from nanovllm.attention import AttentionBackend, AttentionMetadata, QKTransform
from nanovllm.kernels.kv_layout import KVLayout


class Attention(nn.Module):
    """Paged attention over one layer's cache; ``k_cache``/``v_cache`` and their ``kv_layout``
    are set by the runner."""

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
        self.kv_layout = KVLayout.DIM_MAJOR

    def warm_up(self, max_prompt_tokens: int, dtype: torch.dtype) -> None:
        """The backend's start-up work for this layer's shapes (see
        :meth:`~nanovllm.attention.AttentionBackend.warm_up`)."""
        self.backend.warm_up(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.scale,
            dtype,
            self.k_cache,
            max_prompt_tokens,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        transform: QKTransform,
        meta: AttentionMetadata,
        last_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: ``[tokens, heads, head_dim]``; k, v: ``[tokens, kv_heads, head_dim]``, before
        ``transform`` (q and k may be rewritten in place). ``last_tokens``: in a step with prompt
        rows, the index of each row's last token (``StepInputs.last_token_index``): only those
        rows are attended and returned, every token's K/V still stored."""
        backend, cache = self.backend, (self.k_cache, self.v_cache, self.kv_layout)
        if not meta.is_prefill:
            return backend.prepare_and_decode(q, k, v, *cache, meta, transform, self.scale)
        q, k = backend.prepare(q, k, v, *cache, meta.slot_mapping, transform)
        if last_tokens is not None:  # one query a row, over its whole context: a decode step's form
            return backend.decode(q[last_tokens], *cache, meta.last_tokens, self.scale)
        d = meta.num_decode_tokens
        if not d:
            return backend.prefill(q, k, v, *cache, meta, self.scale)
        # each part written into its rows of one output: no concatenation after
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        backend.decode(q[:d], *cache, meta.decode, self.scale, out=out[:d])
        backend.prefill(q[d:], k[d:], v[d:], *cache, meta, self.scale, out=out[d:])
        return out
