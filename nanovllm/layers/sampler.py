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


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if st.all_greedy:
            return greedy
        logits = logits.float() / st.temperatures.clamp(min=1e-6).unsqueeze(1)
        if st.top_ks is not None or st.top_ps is not None or st.min_ps is not None:
            logits = self._filter(logits, st)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        if st.seeds is not None:
            for row, (seed, step) in enumerate(zip(st.seeds, st.steps)):
                if seed is not None:
                    gen = torch.Generator(probs.device).manual_seed((seed * 1_000_003 + step) % 2**63)
                    noise[row].exponential_(generator=gen)
        # argmax(p / E) with E ~ Exp(1) draws from p (the exponential-race form of Gumbel-max)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(st.temperatures == 0, greedy, sampled)

    @staticmethod
    def _filter(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
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
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)
