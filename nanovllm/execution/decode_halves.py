"""A large decode batch run as two halves on two CUDA streams inside one graph.

Where a step's attention is bound by memory and its projections by launch latency (a small
model at a large batch), one half's projections, norms and activations can run while the other
half's attention streams its K/V. The second half starts once the first reaches its first
attention, so the two stay out of phase; the kernels that are not attention run on streams of
high priority, so that the SMs go to them first when the other half's attention frees one.
Each half reads every weight again, which costs little where the weights are small beside the
step's K/V.
"""

import os
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.attention import AttentionMetadata

DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]

MODES = ("off", "high", "offset-high", "attention-low")
_HIGHEST = -8  # torch clamps a stream priority to the device's range


def halves_mode() -> str:
    """How decode graphs split a batch (``NANOVLLM_DECODE_HALVES``): ``off``; ``high``: the
    second half on a high-priority stream from the start; ``offset-high``: so, from the first
    half's first attention on; ``attention-low``: offset, and every kernel but attention at high
    priority."""
    mode = os.environ.get("NANOVLLM_DECODE_HALVES", "off")
    if mode not in MODES:
        raise ValueError(f"NANOVLLM_DECODE_HALVES must be one of {MODES}, got {mode!r}")
    return mode


class DecodeHalves:
    """``forward`` over a decode batch's rows ``[0, n/2)`` and ``[n/2, n)`` as described in the
    module docstring; each half's attention runs its rows longest context first. Meant for
    CUDA-graph capture: hooks on ``attentions`` (the model's attention layers, first to last)
    are set for the call only."""

    def __init__(self, forward: DecodeForward, attentions: list[nn.Module], mode: str):
        if mode not in MODES[1:]:
            raise ValueError(f"mode must be one of {MODES[1:]}, got {mode!r}")
        self.forward, self.attentions, self.mode = forward, attentions, mode
        self.streams = [torch.cuda.Stream(priority=_HIGHEST) for _ in range(2)]
        self.attention_streams = {s: torch.cuda.Stream() for s in self.streams}  # default: lowest
        self.at_first_attention = torch.cuda.Event()

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        main = torch.cuda.current_stream()
        first = self.streams[0] if self.mode == "attention-low" else main
        second = self.streams[1]
        hooks = [self.attentions[0].register_forward_pre_hook(lambda *_: self.at_first_attention.record())]
        if self.mode == "attention-low":
            for layer in self.attentions:
                hooks.append(layer.register_forward_pre_hook(self._to_attention_stream))
                hooks.append(layer.register_forward_hook(self._back_from_attention_stream))
        halves = []
        for start, end in ((0, n // 2), (n // 2, n)):
            half = meta.rows(start, end)
            half.decode_order = torch.argsort(half.context_lens, descending=True, stable=True).int()
            halves.append((input_ids[start:end], positions[start:end], half))
        for stream in {first, second} - {main}:
            stream.wait_stream(main)
        try:
            with torch.cuda.stream(first):
                out_first = self.forward(*halves[0])
            hooks.pop(0).remove()
            if self.mode != "high":
                second.wait_event(self.at_first_attention)
            with torch.cuda.stream(second):
                out_second = self.forward(*halves[1])
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
