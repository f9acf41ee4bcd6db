"""The new sampler paths on CUDA, eager and with CUDA graphs: logits processing (penalties,
bias, allowed tokens) against HF ``generate`` with the same processors, and logprobs against
HF's log-softmax."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.end_to_end.hf_oracle import hf_generate, hf_logprobs, hf_model
from tests.end_to_end.penalty_cases import FEATURES, check_features_matter, greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
OPTIONS = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=16, kvcache_block_size=16)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_logits_processing_matches_hf(qwen3_dir, prompts, eager):
    batch = prompts[1:] + prompts
    params = [p for f in FEATURES for p in (f, greedy())][: len(batch)]
    check_features_matter(qwen3_dir, batch, params)
    with LLM(qwen3_dir, **OPTIONS, enforce_eager=eager) as llm:
        ours = [o["token_ids"] for o in llm.generate(batch, params, use_tqdm=False)]
    assert ours == [hf_generate(qwen3_dir, q, p) for q, p in zip(batch, params)]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_logprobs_match_hf(qwen3_dir, prompts, eager):
    params = [SamplingParams(0.8, 12, True, logprobs=4, seed=i) for i in range(len(prompts))]
    params[0] = SamplingParams(0.8, 12, True, seed=9)  # a row without logprobs in the batch
    with LLM(qwen3_dir, **OPTIONS, enforce_eager=eager) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[0].outputs[0].logprobs is None
    for prompt, out in zip(prompts[1:], outs[1:]):
        completion = out.outputs[0]
        want = hf_logprobs(hf_model(qwen3_dir), prompt, completion.token_ids)
        for t, (entry, token) in enumerate(zip(completion.logprobs, completion.token_ids)):
            top = want[t].topk(4)
            assert set(entry) == set(top.indices.tolist()) | {token}
            assert entry[token].logprob == pytest.approx(want[t, token].item(), abs=1e-3)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_prompt_logprobs_match_hf(qwen3_dir, prompts, eager):
    prompt = prompts[-1]
    with LLM(qwen3_dir, **OPTIONS, enforce_eager=eager, max_num_batched_tokens=32) as llm:
        out = llm.generate([prompt], SamplingParams(0.0, 4, True, prompt_logprobs=3), use_tqdm=False)[0]
    with torch.no_grad():
        want = torch.log_softmax(hf_model(qwen3_dir)(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    for t in range(1, len(prompt)):
        entry = out.prompt_logprobs[t]
        assert set(entry) == set(want[t - 1].topk(3).indices.tolist()) | {prompt[t]}
        assert entry[prompt[t]].logprob == pytest.approx(want[t - 1, prompt[t]].item(), abs=1e-3)


def test_sampled_rows_keep_to_allowed_tokens(qwen3_dir, prompts):
    """Rows drawn at a temperature (the sampling kernel, fed -inf logits) never leave their
    allowed tokens, with top-k / top-p on or off."""
    allowed = list(range(100, 400, 3))
    params = [
        SamplingParams(1.0, 24, True, allowed_token_ids=allowed, seed=1),
        SamplingParams(0.8, 24, True, allowed_token_ids=allowed, top_k=5, top_p=0.9),
        SamplingParams(1.0, 24, True, seed=2),
    ]
    with LLM(qwen3_dir, **OPTIONS) as llm:
        outs = llm.generate(prompts[:3], params, use_tqdm=False)
    assert all(set(o["token_ids"]) <= set(allowed) for o in outs[:2])
    assert not set(outs[2]["token_ids"]) <= set(allowed)
