"""Sampler on CPU: greedy, temperature, top-k, top-p, min-p and per-request seeds.

Expected distributions come from softmax and the filter definitions (top-k: the k largest;
top-p: the smallest set of top tokens whose probability reaches p; min-p: tokens with at
least min_p times the top probability; survivors renormalised). Empirical frequencies are
compared with a chi-square statistic against its 99.99% quantile, with fixed torch seeds.
"""

import pytest
import torch

from tests.execution.sampling_helpers import CHI2_9999, assert_matches, chi2, sampler, tensors


def draw(logits_row: torch.Tensor, n: int, **params) -> torch.Tensor:
    """Counts per token of ``n`` independent samples (one batch of ``n`` equal rows)."""
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    out = sampler(logits, tensors(n, **params))
    assert out.shape == (n,)
    return torch.bincount(out, minlength=logits_row.numel())


def logits_from_probs(probs: list[float], order: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits whose softmax puts ``probs[i]`` on token ``order[i]`` (shuffled, so sorting matters)."""
    p = torch.zeros(len(probs), dtype=torch.float64)
    p[order] = torch.tensor(probs, dtype=torch.float64)
    return p.log().float(), p


def renorm(p: torch.Tensor, keep: list[int]) -> torch.Tensor:
    q = torch.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


# Four tokens with probabilities 0.5, 0.3, 0.15, 0.05 at shuffled positions.
ORDER = [2, 0, 3, 1]  # token ORDER[i] has the i-th largest probability
LOGITS4, P4 = logits_from_probs([0.5, 0.3, 0.15, 0.05], ORDER)


def assert_draws_from_ranks(counts: torch.Tensor, keep_ranks: list[int]) -> None:
    """Only the tokens of these probability ranks were drawn, in their renormalised shares."""
    keep = [ORDER[r] for r in keep_ranks]
    assert set(torch.nonzero(counts).flatten().tolist()) == set(keep)
    assert_matches(counts, renorm(P4, keep))


# ----------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(64, 300) * 3).to(dtype)
    want = logits.float().argmax(-1)
    assert torch.equal(sampler(logits, tensors(64, temperature=0.0)), want)
    # the non-fast path (all_greedy unset, filters present) must agree
    st = tensors(64, temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)
    st.all_greedy = False
    assert torch.equal(sampler(logits, st), want)


def test_sampler_does_not_modify_logits():
    torch.manual_seed(1)
    logits = torch.randn(8, 50)
    before = logits.clone()
    sampler(logits, tensors(8, temperature=0.7, top_k=10, top_p=0.8, min_p=0.05))
    assert torch.equal(logits, before)


def test_mixed_batch_of_greedy_and_sampled_rows():
    torch.manual_seed(2)
    n = 400
    logits = torch.randn(n, 30) * 0.3  # fairly flat: sampled rows rarely hit the argmax
    temps = [0.0 if i % 2 == 0 else 1.0 for i in range(n)]
    top_ks = [-1 if i % 4 else 3 for i in range(n)]
    out = sampler(logits, tensors(n, temperature=temps, top_k=top_ks))
    greedy = logits.argmax(-1)
    assert torch.equal(out[0::2], greedy[0::2])
    sampled_hits = (out[1::2] == greedy[1::2]).float().mean().item()
    assert sampled_hits < 0.5, "rows with temperature 1 must sample, not take the argmax"


def test_very_low_temperature_approaches_greedy():
    torch.manual_seed(3)
    logits = torch.randn(500, 40)
    out = sampler(logits, tensors(500, temperature=1e-4))
    assert torch.equal(out, logits.argmax(-1))


# --------------------------------------------------------------------- distributions


def test_distribution_matches_softmax_at_temperature_one():
    torch.manual_seed(4)
    logits = torch.randn(8)
    counts = draw(logits, 20_000)
    probs = logits.double().softmax(-1)
    assert_matches(counts, probs)
    # the check has power: a uniform sampler would be rejected
    assert chi2(counts, torch.full((8,), 1 / 8)) > 10 * CHI2_9999[7]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_distribution(temperature):
    torch.manual_seed(5)
    logits = torch.randn(8) * 1.5
    counts = draw(logits, 20_000, temperature=temperature)
    assert_matches(counts, (logits.double() / temperature).softmax(-1))
    assert chi2(counts, logits.double().softmax(-1)) > 5 * CHI2_9999[7], "temperature was ignored"


def test_higher_temperature_flattens():
    torch.manual_seed(6)
    logits = torch.tensor([3.0, 1.0, 0.0, -1.0])
    top = logits.argmax().item()
    share = {t: draw(logits, 10_000, temperature=t)[top].item() / 10_000 for t in (0.25, 1.0, 4.0)}
    assert share[0.25] > share[1.0] > share[4.0]


# ----------------------------------------------------------------------------- top-k


def test_top_k_1_is_greedy():
    torch.manual_seed(7)
    logits = torch.randn(300, 100)
    out = sampler(logits, tensors(300, temperature=1.0, top_k=1))
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_samples_only_the_k_largest_with_renormalised_probs():
    torch.manual_seed(8)
    logits = torch.randn(20)
    k = 5
    top = logits.topk(k).indices.tolist()
    counts = draw(logits, 20_000, top_k=k)
    assert set(torch.nonzero(counts).flatten().tolist()) == set(top)
    assert_matches(counts, renorm(logits.double().softmax(-1), top))


@pytest.mark.parametrize("disabled", [-1, 0])
def test_top_k_disabled_values_keep_everything(disabled):
    torch.manual_seed(9)
    logits = torch.randn(8)
    # another row enables top-k, so the tensor exists and the disabled value is interpreted
    n = 20_000
    batch = torch.stack([logits] * n + [logits])
    out = sampler(batch, tensors(n + 1, top_k=[disabled] * n + [2]))
    assert_matches(torch.bincount(out[:n], minlength=8), logits.double().softmax(-1))


def test_top_k_per_row():
    torch.manual_seed(10)
    logits = torch.randn(6, 50)
    ks = [1, 2, 3, 5, 10, 50]
    for _ in range(30):
        out = sampler(logits, tensors(6, top_k=ks))
        for row, k in enumerate(ks):
            assert out[row].item() in logits[row].topk(k).indices.tolist()


# ----------------------------------------------------------------------------- top-p


@pytest.mark.parametrize(
    "top_p, keep_ranks",
    [
        (0.4, [0]),  # the top token alone already reaches 0.4
        (0.6, [0, 1]),  # 0.5 < 0.6 <= 0.8
        (0.9, [0, 1, 2]),  # 0.8 < 0.9 <= 0.95
        (0.97, [0, 1, 2, 3]),
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, keep_ranks):
    torch.manual_seed(11)
    counts = draw(LOGITS4, 20_000, top_p=top_p)
    assert_draws_from_ranks(counts, keep_ranks)


def test_top_p_is_applied_after_temperature():
    """At a very high temperature the four tokens are nearly equally likely, so top_p=0.6
    needs three of them; applied before temperature it would keep only two."""
    torch.manual_seed(12)
    counts = draw(LOGITS4, 20_000, temperature=100.0, top_p=0.6)
    assert counts[ORDER[3]].item() == 0
    assert all(counts[ORDER[r]].item() > 4000 for r in range(3))


def test_top_p_applies_to_top_k_survivors():
    """top-k first, then top-p on the renormalised survivors (vLLM's order): with
    probabilities 0.5/0.3 renormalised to 0.625/0.375, top_p=0.55 keeps the top token only."""
    torch.manual_seed(13)
    counts = draw(LOGITS4, 5_000, top_k=2, top_p=0.55)
    assert counts[ORDER[0]].item() == 5_000


# ----------------------------------------------------------------------------- min-p


@pytest.mark.parametrize(
    "min_p, keep_ranks",
    [
        (0.0, [0, 1, 2, 3]),
        (0.08, [0, 1, 2, 3]),  # threshold 0.04 < 0.05
        (0.2, [0, 1, 2]),  # threshold 0.1
        (0.5, [0, 1]),  # threshold 0.25
        (0.7, [0]),  # threshold 0.35
        (1.0, [0]),
    ],
)
def test_min_p_keeps_tokens_above_a_fraction_of_the_top(min_p, keep_ranks):
    torch.manual_seed(14)
    counts = draw(LOGITS4, 20_000, min_p=min_p)
    assert_draws_from_ranks(counts, keep_ranks)


def test_filters_never_pick_masked_tokens():
    torch.manual_seed(15)
    logits = torch.randn(200, 64)
    logits[:, ::2] = float("-inf")
    for kw in ({}, {"top_k": 40}, {"top_p": 0.99}, {"min_p": 0.001}, {"top_k": 50, "top_p": 0.999}):
        out = sampler(logits, tensors(200, **kw))
        assert (out % 2 == 1).all(), kw
