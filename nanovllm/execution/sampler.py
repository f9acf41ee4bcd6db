"""Token sampling: per-request logits processing, then greedy, temperature, top-k, top-p,
min-p, per-request seeds."""

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from nanovllm.execution.logits_processors import LogitsTensors, process_logits, record_samples
from nanovllm.kernels.sample import greedy_tokens, sample_tokens, sample_tokens_ref
from nanovllm.scheduling.step import NewSlot

_U64, _I64_SPAN = 2**64 - 1, 2**64


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters of one batch, on the logits' device (built as host arrays
    that :func:`~nanovllm.execution.upload.upload` moves there)."""

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


class SamplingSlots:
    """Each slot's sampling parameters, as arrays a batch gathers from."""

    def __init__(self, num_slots: int):
        self.temperature = np.ones(num_slots, dtype=np.float32)
        self.top_k = np.full(num_slots, -1, dtype=np.int64)
        self.top_p = np.ones(num_slots, dtype=np.float32)
        self.min_p = np.zeros(num_slots, dtype=np.float32)
        self.seeded = np.zeros(num_slots, dtype=bool)
        self.seed = np.zeros(num_slots, dtype=np.int64)
        self.num_logprobs = np.full(num_slots, -1, dtype=np.int64)
        self.any_logprobs = False

    def assign(self, new: NewSlot) -> None:
        p, slot = new.params, new.slot
        self.temperature[slot], self.top_k[slot] = p.temperature, p.top_k
        self.top_p[slot], self.min_p[slot] = p.top_p, p.min_p
        self.seeded[slot] = p.seed is not None
        self.num_logprobs[slot] = -1 if p.logprobs is None else p.logprobs
        self.any_logprobs |= p.logprobs is not None
        if p.seed is not None:  # any Python int, as its 64 bits
            bits = p.seed & _U64
            self.seed[slot] = bits - _I64_SPAN if bits >> 63 else bits

    def max_logprobs(self, slots: np.ndarray) -> int | None:
        """The most top log-probabilities a row of the batch asks for; None when none asks."""
        if not self.any_logprobs:
            return None
        k = int(self.num_logprobs[slots].max())
        return k if k >= 0 else None

    def gather(self, slots: np.ndarray, num_generated: np.ndarray) -> SamplingTensors:
        """The batch's rows, as host arrays; a filter no row uses is left out. A seeded row's
        draw depends on how many tokens it generated before (``num_generated``)."""
        temperatures = self.temperature[slots]
        st = SamplingTensors(temperatures, all_greedy=not temperatures.any())
        top_k, top_p, min_p = self.top_k[slots], self.top_p[slots], self.min_p[slots]
        if (top_k > 0).any():
            st.top_ks = top_k
        if (top_p < 1).any():
            st.top_ps = top_p
        if (min_p > 0).any():
            st.min_ps = min_p
        seeded = self.seeded[slots]
        if seeded.any():
            st.seeds = self.seed[slots]
            st.steps = np.where(seeded, num_generated, -1)
        return st


class Sampler(nn.Module):
    """Filters the logits when a row asks for it, then draws with the sampling kernel (CUDA)
    or its torch reference (CPU), from one uniform per row: from ``generator`` (torch's
    default when None), or from the row's own seed. A row with no token to give gets
    :data:`~nanovllm.kernels.sample.NO_TOKEN` or :data:`~nanovllm.kernels.sample.NOT_FINITE`."""

    def __init__(self, generator: torch.Generator | None = None):
        super().__init__()
        self.generator = generator

    def forward(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        if st.processing is None:
            return self._sample(logits, st)
        tokens = self._sample(process_logits(logits, st.processing), st)
        record_samples(st.processing, tokens)
        return tokens

    def _sample(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        if st.all_greedy:
            return greedy_tokens(logits)
        if st.top_ks is not None or st.top_ps is not None or st.min_ps is not None:
            scaled = logits.float() / st.temperatures.clamp(min=1e-6).unsqueeze(1)
            logits = logits.float().masked_fill(self._removed(scaled, st), float("-inf"))
        uniforms = torch.rand(logits.shape[0], device=logits.device, generator=self.generator)
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
