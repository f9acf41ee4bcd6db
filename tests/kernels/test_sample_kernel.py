"""The sampling kernel against its torch reference (Triton interpreter on CPU, or CUDA).

Given the same uniforms both must pick the token whose cumulative-probability interval
holds the uniform; float rounding may only move a pick that lies on an interval's edge.
"""

import pytest
import torch

from nanovllm.kernels import sample as kernel
from tests.interpreter import DEVICE


def assert_in_interval(tokens, logits, temps, uniforms, eps=1e-5):
    """Each sampled row's token lies in the cdf interval that holds its uniform."""
    probs = (logits.float() / temps.clamp(min=1e-6).unsqueeze(1)).softmax(-1).double()
    cdf = probs.cumsum(-1)
    for row, tok in enumerate(tokens.tolist()):
        if temps[row] == 0:
            assert tok == logits[row].float().argmax().item(), row
            continue
        target = uniforms[row].item() * cdf[row, -1].item()
        below = cdf[row, tok - 1].item() if tok else 0.0
        assert probs[row, tok] > 0, (row, tok)
        assert below <= target + eps and cdf[row, tok].item() > target - eps, (row, tok, target)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [1, 37, 2048, 5000, 20000])
def test_sample_matches_reference(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 12
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(dtype)
    logits[3, 1::3] = float("-inf")  # filtered tokens
    temps = torch.tensor([0.0, 1.0, 0.6, 1e-4, 2.0, 0.0, 1.0, 0.3, 1.5, 0.9, 1.0, 0.7])
    uniforms = torch.rand(rows, generator=gen)
    uniforms[1], uniforms[2] = 0.0, 1 - 2**-24  # both ends of [0, 1)
    logits, temps, uniforms = logits.to(DEVICE), temps.to(DEVICE), uniforms.to(DEVICE)
    out = kernel.sample_tokens(logits, temps, uniforms)
    ref = kernel.sample_tokens_ref(logits, temps, uniforms)
    assert out.dtype == torch.int64 and out.shape == (rows,)
    assert_in_interval(out.cpu(), logits.cpu(), temps.cpu(), uniforms.cpu())
    assert_in_interval(ref.cpu(), logits.cpu(), temps.cpu(), uniforms.cpu())
    assert (out == ref).float().mean().item() >= 0.9


def test_greedy_takes_the_first_of_tied_maxima():
    logits = torch.zeros(4, 9000)  # ties within a chunk of the first kernel and across chunks
    logits[0, [5, 4000]] = 1.0
    logits[1, [2049, 3000, 8999]] = 1.0
    logits[2, :] = -1.0
    logits[3, [4097, 8200]] = 1.0
    logits = logits.to(DEVICE)
    out = kernel.sample_tokens(logits, torch.zeros(4, device=DEVICE), torch.zeros(4, device=DEVICE))
    assert out.tolist() == [5, 2049, 0, 4097]


def test_only_token_left_is_always_drawn():
    logits = torch.full((4, 9000), float("-inf"))  # the last of three chunks holds all the mass
    logits[:, 8999] = 0.0
    logits[1, 7] = -200.0  # a token whose probability underflows to 0 at low temperature
    uniforms = torch.tensor([0.0, 0.5, 0.999999, 1 - 2**-24])
    temps = torch.tensor([1.0, 0.05, 1.0, 3.0])
    out = kernel.sample_tokens(logits.to(DEVICE), temps.to(DEVICE), uniforms.to(DEVICE))
    assert out.tolist() == [8999] * 4


def test_bad_stride_is_refused():
    logits = torch.randn(8, 4, device=DEVICE).t()
    with pytest.raises(ValueError, match="unit stride"):
        kernel.sample_tokens(logits, torch.ones(4, device=DEVICE), torch.rand(4, device=DEVICE))


def test_seeded_rows_draw_from_their_seed_and_step_alone():
    rows, vocab = 6, 3000
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, vocab, generator=gen)
    temps = torch.tensor([1.0, 0.8, 0.0, 1.3, 1.0, 0.5])
    uniforms = torch.rand(rows, generator=gen)
    seeds = torch.tensor([7, -1, 3, 2**63 - 1, 0, -(2**63)], dtype=torch.int64)
    steps = torch.tensor([0, 5, 2, -1, 1000, 3], dtype=torch.int64)  # row 3 is unseeded
    seeded = kernel.seeded_uniforms_ref(seeds, steps)
    assert ((seeded >= 0) & (seeded < 1)).all()
    expected_u = torch.where(steps >= 0, seeded, uniforms)
    args = [t.to(DEVICE) for t in (logits, temps, uniforms, seeds, steps)]
    out = kernel.sample_tokens(*args).cpu()
    ref = kernel.sample_tokens_ref(*args).cpu()
    assert_in_interval(out, logits, temps, expected_u)
    assert_in_interval(ref, logits, temps, expected_u)
    # the same row alone, at another position, with other uniforms: the same token
    for row in (0, 4, 5):
        logit_row, temp, seed, step = (t[row : row + 1].to(DEVICE) for t in (logits, temps, seeds, steps))
        other_uniform = torch.rand(1, device=DEVICE)
        assert kernel.sample_tokens(logit_row, temp, other_uniform, seed, step).item() == out[row].item()


def test_seeded_uniforms_match_the_murmur3_finaliser():
    def fmix(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    seeds, steps = [0, 1, 12345, -5, 2**63 - 1], [0, 7, 2**31 - 1, 3, 99]
    got = kernel.seeded_uniforms_ref(torch.tensor(seeds), torch.tensor(steps)).tolist()
    for seed, step, u in zip(seeds, steps, got):
        bits = seed & (2**64 - 1)
        h = fmix(fmix(fmix(step ^ 0x9E3779B9) ^ (bits >> 32)) ^ (bits & 0xFFFFFFFF))
        assert u == (h >> 8) * 2.0**-24


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy, on NaN and inf
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rows_without_a_token_are_marked(temperature):
    """Every logit masked: NO_TOKEN; a NaN or +inf anywhere in a row: NOT_FINITE; never an id."""
    vocab = 5000
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    logits[1] = float("-inf")
    logits[2, 4321] = float("nan")
    logits[3, 7] = float("inf")
    logits[4, :4096] = float("-inf")  # masked but for the second chunk: still sampled
    temps, uniforms = torch.full((5,), temperature), torch.full((5,), 0.5)
    logits, temps, uniforms = logits.to(DEVICE), temps.to(DEVICE), uniforms.to(DEVICE)
    want = [None, kernel.NO_TOKEN, kernel.NOT_FINITE, kernel.NOT_FINITE, None]
    outs = [kernel.sample_tokens(logits, temps, uniforms), kernel.sample_tokens_ref(logits, temps, uniforms)]
    if temperature == 0:
        outs.append(kernel.greedy_tokens(logits))
    for out in outs:
        out = out.tolist()
        assert [w if w is None else out[i] for i, w in enumerate(want)] == want
        assert 0 <= out[0] < vocab and 4096 <= out[4] < vocab


def test_the_markers_are_the_step_outputs():
    from nanovllm.scheduling.step import NO_TOKEN, NOT_FINITE

    assert (kernel.NO_TOKEN, kernel.NOT_FINITE) == (NO_TOKEN, NOT_FINITE)
