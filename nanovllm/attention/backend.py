"""The interface every attention backend implements, and the metadata it reads."""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what each query attends to.

    ``context_lens`` counts each sequence's cached tokens after this step's tokens are
    stored; for decode there is one query token per sequence.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 1
    max_seqlen_k: int = 0
    has_prefix: bool = False
    """True when some sequence attends to keys computed in an earlier step."""


class AttentionBackend:
    """Stores new K/V in the paged cache and computes attention for prefill and decode."""

    name: str = ""
    supports_cuda_graphs: bool = True

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        raise NotImplementedError

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        raise NotImplementedError

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        raise NotImplementedError
