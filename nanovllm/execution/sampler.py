"""Token sampling: per-request logits processing, then greedy, temperature, top-k, top-p,
min-p, per-request seeds."""

from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.execution.logits_processors import LogitsTensors, process_logits, record_samples
from nanovllm.kernels.sample import sample_tokens, sample_tokens_ref


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters of one batch, already on the logits' device."""

    temperatures: torch.Tensor
    top_ks: torch.Tensor | None = None
    top_ps: torch.Tensor | None = None
    min_ps: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    """int64; with ``steps``, rows whose step is >= 0 draw from ``(seed, step)`` alone, so they
    reproduce exactly whatever else runs in the batch."""
    steps: torch.Tensor | None = None
    all_greedy: bool = False
    processing: LogitsTensors | None = None
    """Allowed tokens, logit bias, min_tokens and penalties, applied first; None: no row has any."""


class Sampler(nn.Module):
    """Filters the logits when a row asks for it, then draws with the sampling kernel (CUDA)
    or its torch reference (CPU), from one uniform per row."""

    def forward(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        if st.processing is None:
            return self._sample(logits, st)
        tokens = self._sample(process_logits(logits, st.processing), st)
        record_samples(st.processing, tokens)
        return tokens

    def _sample(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        if st.all_greedy:
            return logits.argmax(dim=-1)
        if st.top_ks is not None or st.top_ps is not None or st.min_ps is not None:
            scaled = logits.float() / st.temperatures.clamp(min=1e-6).unsqueeze(1)
            logits = logits.float().masked_fill(self._removed(scaled, st), float("-inf"))
        uniforms = torch.rand(logits.shape[0], device=logits.device)
        sample = sample_tokens if logits.is_cuda else sample_tokens_ref
        return sample(logits, st.temperatures, uniforms, st.seeds, st.steps)

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
