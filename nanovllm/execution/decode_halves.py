"""A large decode step's rows as two halves on two CUDA streams, inside its graph.

A decode step's projections are bound by the tensor cores once its rows are well past the
card's ridge (~160 rows on an H200 at the 8B shape), its attention by reading K/V. Run as two
independent halves, one half's projections can run while the other's attention streams its
K/V; each half reads every weight again, which costs little where the products, not the
weights, set the GEMMs' time. Off by default (``NANOVLLM_DECODE_HALVES``): on an H100 the
halves lost 10-12% at every 8B size its cache holds (256-312-row halves) and end to end at the
0.6B shape (``benchmarks/MEASUREMENTS.md``); the modes are kept to measure larger steps.
"""

import os
from dataclasses import fields, replace

import torch
from torch import nn

from nanovllm.attention import AttentionMetadata
from nanovllm.layers.attention import Attention

MODES = ("off", "high", "offset-high", "attention-low")
_HIGHEST = -8  # torch clamps a stream priority to the device's range


def halves_setting() -> tuple[str, int]:
    """The mode (``NANOVLLM_DECODE_HALVES``, default ``off``) and the smallest graph size run in
    halves (``NANOVLLM_DECODE_HALVES_MIN_ROWS``, default 768). Modes: ``high``: the second half
    on a high-priority stream from the start; ``offset-high``: so, from the first half's first
    attention on (one half's attention meets the other's GEMMs, not its attention);
    ``attention-low``: offset, and every kernel but attention at high priority, so that the SMs an
    attention frees go to the other half's GEMMs first."""
    mode = os.environ.get("NANOVLLM_DECODE_HALVES", "off")
    if mode not in MODES:
        raise ValueError(f"NANOVLLM_DECODE_HALVES must be one of {MODES}, got {mode!r}")
    min_rows = os.environ.get("NANOVLLM_DECODE_HALVES_MIN_ROWS", "768")
    if not min_rows.isdigit() or int(min_rows) < 2:
        raise ValueError(f"NANOVLLM_DECODE_HALVES_MIN_ROWS must be an integer >= 2, got {min_rows!r}")
    return mode, int(min_rows)


def rows_of(meta: AttentionMetadata, start: int, end: int) -> AttentionMetadata:
    """Rows ``start:end`` of a decode batch's metadata as a batch of their own, longest context
    first. Every tensor field of a decode batch holds one row per sequence."""
    tensors = [f.name for f in fields(meta) if isinstance(getattr(meta, f.name), torch.Tensor)]
    half = replace(meta, **{name: getattr(meta, name)[start:end] for name in tensors})
    half.decode_order = torch.argsort(half.context_lens, descending=True, stable=True).int()
    return half


class DecodeHalves:
    """``model``'s forward over a decode batch's rows ``[0, n/2)`` and ``[n/2, n)`` in ``mode``
    (:func:`halves_setting`), taken for batches of ``min_rows`` or more. Meant for CUDA-graph
    capture: hooks on the model's attention layers are set for the call only. Off CUDA the halves
    run one after the other (the same outputs, for tests)."""

    @classmethod
    def from_environment(cls, model: nn.Module, tp_size: int) -> "DecodeHalves | None":
        """The halves :func:`halves_setting` asks for; None when off, or over several ranks (two
        streams' all-reduces could cross)."""
        mode, min_rows = halves_setting()
        return cls(model, mode, min_rows) if mode != "off" and tp_size == 1 else None

    def __init__(self, model: nn.Module, mode: str, min_rows: int = 2):
        if mode not in MODES[1:]:
            raise ValueError(f"mode must be one of {MODES[1:]}, got {mode!r}")
        self.model, self.mode, self.min_rows = model, mode, min_rows
        self.attentions = [m for m in model.modules() if isinstance(m, Attention)]
        self.streams, self.attention_streams = [], {}
        if torch.cuda.is_available():
            self.streams = [torch.cuda.Stream(priority=_HIGHEST) for _ in range(2)]
            self.attention_streams = {s: torch.cuda.Stream() for s in self.streams}  # default: lowest
            self.at_first_attention = torch.cuda.Event()

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        rope_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        halves = []
        for a, b in ((0, n // 2), (n // 2, n)):
            lengths = None if rope_lengths is None else rope_lengths[a:b]
            halves.append((input_ids[a:b], positions[a:b], rows_of(meta, a, b), lengths))
        if input_ids.device.type != "cuda":
            return torch.cat([self.model(*half) for half in halves])
        main = torch.cuda.current_stream()
        first = self.streams[0] if self.mode == "attention-low" else main
        second = self.streams[1]
        hooks = [self.attentions[0].register_forward_pre_hook(lambda *_: self.at_first_attention.record())]
        if self.mode == "attention-low":
            for layer in self.attentions:
                hooks.append(layer.register_forward_pre_hook(self._to_attention_stream))
                hooks.append(layer.register_forward_hook(self._back_from_attention_stream))
        for stream in {first, second} - {main}:
            stream.wait_stream(main)
        try:
            with torch.cuda.stream(first):
                out_first = self.model(*halves[0])
            hooks.pop(0).remove()
            if self.mode != "high":
                second.wait_event(self.at_first_attention)
            with torch.cuda.stream(second):
                out_second = self.model(*halves[1])
        finally:
            for hook in hooks:
                hook.remove()
        for stream in {first, second} - {main}:
            main.wait_stream(stream)
        return torch.cat((out_first, out_second))

    def _to_attention_stream(self, *_) -> None:
        here = torch.cuda.current_stream()
        there = self.attention_streams[here]
        there.wait_stream(here)
        torch.cuda.set_stream(there)

    def _back_from_attention_stream(self, *_) -> None:
        there = torch.cuda.current_stream()
        here = next(s for s, a in self.attention_streams.items() if a == there)
        here.wait_stream(there)
        torch.cuda.set_stream(here)
