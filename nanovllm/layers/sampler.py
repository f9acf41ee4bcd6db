"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds."""

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters of one batch, already on the logits' device."""

    temperatures: torch.Tensor
    top_ks: torch.Tensor | None = None
    top_ps: torch.Tensor | None = None
    min_ps: torch.Tensor | None = None
    seeds: list[int | None] | None = None
    """Rows with a seed draw their noise from ``(seed, step)``, so they reproduce exactly."""
    steps: list[int] | None = None
    all_greedy: bool = False


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Greedy where the temperature is 0, else a draw from ``softmax(logits / T)``.

    ``argmax(p / E)`` with ``E ~ Exp(1)`` draws from ``p`` (the exponential-race form of
    Gumbel-max), so the draw needs no cumulative sums.
    """
    greedy = logits.argmax(dim=-1)
    probs = (logits.float() / temperatures.clamp(min=1e-6).unsqueeze(1)).softmax(dim=-1)
    return torch.where(temperatures == 0, greedy, (probs / noise).argmax(dim=-1))


class Sampler(nn.Module):
    compilable = ("sample_fn",)

    def __init__(self):
        super().__init__()
        self.sample_fn = sample_tokens

    def forward(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        if st.all_greedy:
            return logits.argmax(dim=-1)
        if st.top_ks is not None or st.top_ps is not None or st.min_ps is not None:
            scaled = logits.float() / st.temperatures.clamp(min=1e-6).unsqueeze(1)
            logits = logits.float().masked_fill(self._removed(scaled, st), float("-inf"))
        noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_()
        if st.seeds is not None:
            for row, (seed, step) in enumerate(zip(st.seeds, st.steps)):
                if seed is not None:
                    gen = torch.Generator(logits.device).manual_seed((seed * 1_000_003 + step) % 2**63)
                    noise[row].exponential_(generator=gen)
        return self.sample_fn(logits, st.temperatures, noise)

    @staticmethod
    def _removed(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """Mask of the tokens top-k / top-p / min-p filter out (never the most likely one)."""
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if st.top_ks is not None:
            ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
            k = torch.where(st.top_ks > 0, st.top_ks, logits.shape[-1]).unsqueeze(1)
            remove |= ranks >= k
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        if st.top_ps is not None:
            # drop a token once the tokens ranked above it already reach top_p
            remove |= (probs.cumsum(dim=-1) - probs) >= st.top_ps.unsqueeze(1)
        if st.min_ps is not None:
            remove |= probs < st.min_ps.unsqueeze(1) * probs[:, :1]
        remove[:, 0] = False
        return torch.empty_like(remove).scatter_(1, order, remove)
