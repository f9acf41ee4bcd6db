"""A CPU sampler, its input tensors built from plain values, and a chi-square check of
sampled token counts against expected probabilities."""

import torch

from nanovllm.execution.sampler import Sampler, SamplingTensors

# 99.99% quantiles of the chi-square distribution, by degrees of freedom
CHI2_9999 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}

sampler = Sampler()


def tensors(n, temperature=1.0, top_k=None, top_p=None, min_p=None, seeds=None, steps=None):
    """SamplingTensors for ``n`` rows; scalars are broadcast, lists are per row."""

    def col(v, dtype):
        if v is None:
            return None
        return torch.tensor(v if isinstance(v, list) else [v] * n, dtype=dtype)

    temps = col(temperature, torch.float32)
    if seeds is not None:  # as the step inputs send them: unseeded rows have step -1
        steps = [-1 if s is None else t for s, t in zip(seeds, steps)]
        seeds = [0 if s is None else s for s in seeds]
    return SamplingTensors(
        temps,
        top_ks=col(top_k, torch.int64),
        top_ps=col(top_p, torch.float32),
        min_ps=col(min_p, torch.float32),
        seeds=col(seeds, torch.int64),
        steps=col(steps, torch.int64),
        all_greedy=bool((temps == 0).all()),
    )


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson statistic; tokens of zero probability must never be drawn."""
    probs = probs.double()
    n = counts.sum().item()
    assert counts[probs == 0].sum().item() == 0, f"drew a zero-probability token: {counts.tolist()}"
    keep = probs > 0
    exp = probs[keep] * n
    return (((counts[keep].double() - exp) ** 2) / exp).sum().item()


def assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    dof = int((probs > 0).sum().item()) - 1
    if dof == 0:
        assert counts[probs > 0].item() == counts.sum().item()
        return
    stat = chi2(counts, probs)
    assert stat < CHI2_9999[dof], f"chi2={stat:.1f} (dof {dof}); counts {counts.tolist()}, p {probs.tolist()}"
