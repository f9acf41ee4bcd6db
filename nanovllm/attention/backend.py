"""The interface every attention backend implements, and the metadata it reads."""

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from nanovllm.kernels.kv_layout import KVLayout


def _padded(value: int, why: str):
    """A per-row tensor field; rows that only pad a batch (e.g. up to a CUDA graph's batch
    size) hold ``value``."""
    return field(metadata={"pad": value, "why": why})


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what each query attends to.

    ``context_lens`` counts each sequence's cached tokens after this step's tokens are
    stored; for decode there is one query token per sequence. Per-row fields of a decode step
    declare the value of a row that only pads it (up to a CUDA graph's batch size, :meth:`padding`).
    """

    is_prefill: bool
    slot_mapping: torch.Tensor = _padded(-1, "store no K/V")
    context_lens: torch.Tensor = _padded(1, "attend to one key, in the row's first block")
    block_tables: torch.Tensor
    """``[rows, max_blocks_per_seq]`` block ids (a padding row's are some slot's: they exist)."""
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 1
    seqlens_q: tuple[int, ...] = ()
    """Prefill: each sequence's query tokens, on the host (for backends that launch per sequence)."""
    max_seqlen_k: int = 0
    has_prefix: bool = False
    """True when some sequence attends to keys computed in an earlier step."""
    decode_order: torch.Tensor | None = field(
        default=None, metadata={"pad": -1, "why": "a padding row runs in its own place"}
    )
    """Decode only, optional: the rows in the order their attention should run, longest
    context first, so that no long row starts last and runs on alone (int32; -1: the row's
    own index)."""
    decode: "AttentionMetadata | None" = None
    """In a step that mixes both, the decode rows (one query each), which come first: then
    ``slot_mapping`` covers every token, and the other fields describe the prompt rows only."""
    last_tokens: "AttentionMetadata | None" = None
    """In a step with prompt rows: every row's last token as one query against its whole
    context, in row order (a decode step's form; its ``slot_mapping`` is the step's, every K/V
    stored before), for a layer that only needs those rows' outputs."""

    @property
    def num_decode_tokens(self) -> int:
        return 0 if self.decode is None else self.decode.context_lens.shape[0]

    @staticmethod
    def padding(name: str) -> int:
        """The value of per-row field ``name`` in a row that only pads a batch."""
        pads = {f.name: f.metadata["pad"] for f in fields(AttentionMetadata) if "pad" in f.metadata}
        if name not in pads:
            raise ValueError(f"AttentionMetadata.{name} has no padding value; those that do: {sorted(pads)}")
        return pads[name]


@dataclass(slots=True)
class QKTransform:
    """What q and k go through before k is stored: a per-head RMSNorm when the weights are
    set (Qwen3's q_norm/k_norm), then the rotary embedding at ``positions`` (``cos_sin_cache``:
    ``[max_position, head_dim]`` fp32, cos then sin, rotate-half layout)."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6


class AttentionBackend:
    """Prepares q/k and stores new K/V in the paged cache, and computes attention for prefill
    and decode. Every method takes a layer's caches with their layout (:class:`KVLayout`)."""

    name: str = ""
    supports_cuda_graphs: bool = True

    qk_prologue: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """:func:`~nanovllm.kernels.qk_norm_rope_store.qk_norm_rope_store` or its reference."""

    def prepare(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layout: KVLayout,
        slot_mapping: torch.Tensor,
        t: QKTransform,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply ``t`` to q and k, store k and v in the paged cache; returns q and k."""
        norms = (t.q_norm_weight, t.k_norm_weight, t.eps)
        return self.qk_prologue(
            q, k, v, t.positions, t.cos_sin_cache, *norms, k_cache, v_cache, slot_mapping, layout=layout
        )

    def warm_up(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        dtype: torch.dtype,
        k_cache: torch.Tensor,
        max_prompt_tokens: int,
    ) -> None:
        """Start-up work for a layer of these heads, done before any step (none by default)."""

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layout: KVLayout,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The prompt rows' attention (``meta`` describes them), written to ``out`` when given
        (q's shape and dtype: the prompt rows of a mixed step's output) and returned."""
        raise NotImplementedError

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layout: KVLayout,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query token per row against its cached context, written to ``out`` when given
        (as :meth:`prefill`) and returned."""
        raise NotImplementedError

    @staticmethod
    def written_to(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
        """``result``, copied into ``out`` when given: for kernels that make their own output."""
        return result if out is None else out.copy_(result)

    def prepare_and_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layout: KVLayout,
        meta: AttentionMetadata,
        t: QKTransform,
        scale: float,
    ) -> torch.Tensor:
        """A decode step's attention from the projection's q, k and v: :meth:`prepare`, then
        :meth:`decode` (a backend may do the two in fewer launches)."""
        q, _ = self.prepare(q, k, v, k_cache, v_cache, layout, meta.slot_mapping, t)
        return self.decode(q, k_cache, v_cache, layout, meta, scale)
