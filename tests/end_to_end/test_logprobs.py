"""logprobs: the sampled token's and the top-k log-probabilities of every generated token,
against Hugging Face's log-softmax of the same positions (fp32, CPU)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from tests.end_to_end.hf_oracle import check_prompt_logprobs, hf_logprobs

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=96, kvcache_block_size=16, max_num_seqs=8)
PROMPTS = [[7, 300, 42, 19, 250, 3, 88, 121, 64, 5, 400, 17, 230, 9, 31, 77, 150], [11, 12, 13]]


@pytest.fixture(scope="module")
def hf_model(qwen3_dir):
    return AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("temperature, k", [(0.0, 3), (0.9, 5), (0.9, 0)])
def test_logprobs_match_hf(qwen3_dir, hf_model, async_scheduling, temperature, k):
    params = [
        SamplingParams(temperature, 10, True, logprobs=k, seed=3),
        SamplingParams(temperature, 7, True, logprobs=k + 1, n=2, seed=4),
    ]
    with LLM(qwen3_dir, **OPTIONS, async_scheduling=async_scheduling) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        tokenizer = llm.tokenizer
    for prompt, out, p in zip(PROMPTS, outs, params):
        for completion in out.outputs:
            want = hf_logprobs(hf_model, prompt, completion.token_ids)
            assert len(completion.logprobs) == len(completion.token_ids)
            chosen = want[torch.arange(len(completion.token_ids)), completion.token_ids]
            for t, (entry, token) in enumerate(zip(completion.logprobs, completion.token_ids)):
                top = want[t].topk(p.logprobs)
                assert set(entry) == set(top.indices.tolist()) | {token}
                got = torch.tensor([entry[i].logprob for i in top.indices.tolist()] + [entry[token].logprob])
                torch.testing.assert_close(got, torch.cat([top.values, chosen[t : t + 1]]), atol=1e-4, rtol=0)
                # vLLM's ranks: 1 for the most likely; the chosen token's among the whole vocabulary
                assert [entry[i].rank for i in top.indices.tolist() if i != token] == [
                    r for r, i in enumerate(top.indices.tolist(), start=1) if i != token
                ]
                assert entry[token].rank == int((want[t] > want[t, token]).sum()) + 1
                assert entry[token].decoded_token == tokenizer.decode([token])
            assert completion.cumulative_logprob == pytest.approx(chosen.sum().item(), abs=1e-3)


def test_no_logprobs_by_default(qwen3_dir):
    with LLM(qwen3_dir, **OPTIONS) as llm:
        out = llm.generate([PROMPTS[0]], SamplingParams(0.0, 4, True), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("budget", [None, 7], ids=["whole", "chunked"])
def test_prompt_logprobs_match_hf(qwen3_dir, hf_model, hf_reference, async_scheduling, budget):
    long_prompt = (PROMPTS[0] * 3)[:40]
    options = {**OPTIONS, **({"max_num_batched_tokens": budget} if budget else {})}
    with LLM(qwen3_dir, **options, async_scheduling=async_scheduling) as llm:
        first = llm.generate([long_prompt], SamplingParams(0.0, 3, True), use_tqdm=False)[0]
        assert first.prompt_logprobs is None
        # the same prompt again: it is in the cache, yet every prompt token gets its entry
        params = [
            SamplingParams(0.0, 3, True, prompt_logprobs=2),
            SamplingParams(0.7, 3, True, prompt_logprobs=0, n=2),
            SamplingParams(0.0, 3, True),
        ]
        outs = llm.generate([long_prompt, PROMPTS[1], PROMPTS[0]], params, use_tqdm=False)
    assert outs[0].num_cached_tokens == 0
    check_prompt_logprobs(hf_model, long_prompt, outs[0].prompt_logprobs, 2)
    check_prompt_logprobs(hf_model, PROMPTS[1], outs[1].prompt_logprobs, 0)
    assert outs[2].prompt_logprobs is None
    assert outs[0]["token_ids"] == first["token_ids"] == hf_reference(qwen3_dir, [long_prompt], 3)[0]
