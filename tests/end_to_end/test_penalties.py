"""Logits processing end to end on CPU: greedy tokens equal Hugging Face ``generate`` run with
the same processors (see ``tests/execution/test_logits_processors.py``), in batches where only
some rows use them, with and without async scheduling, prefix-cache hits and preemption.
"""

import json
import shutil

import pytest

from nanovllm import LLM, SamplingParams
from tests.end_to_end.hf_oracle import hf_generate
from tests.end_to_end.penalty_cases import FEATURES, NEW_TOKENS, check_features_matter, greedy

BASE = dict(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=16, kvcache_block_size=16)


def run(model_dir: str, prompts, params, **options) -> list[list[int]]:
    llm = LLM(model_dir, **{**BASE, **options})
    try:
        return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.exit()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_mixed_batch_matches_hf(qwen3_dir, prompts, async_scheduling):
    # plain rows between the ones that use a feature; prompts of every length (the OpenAI
    # penalties go to prompts whose plain completion repeats a token)
    batch = prompts[1:] + prompts
    params = [p for f in FEATURES for p in (f, greedy())][: len(batch)]
    check_features_matter(qwen3_dir, batch, params)
    ours = run(qwen3_dir, batch, params, async_scheduling=async_scheduling)
    assert ours == [hf_generate(qwen3_dir, q, p) for q, p in zip(batch, params)]


def test_chunked_prefill_matches_hf(qwen3_dir, prompts):
    # 7-token steps: penalised rows sample (and discard) at chunk ends before their prompt's
    params = FEATURES[: len(prompts)]
    check_features_matter(qwen3_dir, prompts, params)
    ours = run(qwen3_dir, prompts, params, max_num_batched_tokens=7)
    assert ours == [hf_generate(qwen3_dir, q, p) for q, p in zip(prompts, params)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_repetition_penalty_with_prefix_cache_hits(qwen3_dir, prompts, async_scheduling):
    # the second request's prompt is all in the cache: the executor only sees its last token
    prompt, p = prompts[-1][:48], greedy(repetition_penalty=1.5)
    expected = hf_generate(qwen3_dir, prompt, p)
    assert expected != hf_generate(qwen3_dir, prompt, greedy())
    llm = LLM(qwen3_dir, **BASE, async_scheduling=async_scheduling)
    try:
        first = llm.generate([prompt], p, use_tqdm=False)[0]["token_ids"]
        seq = llm.add_request(prompt, p)
        while not llm.is_finished():
            llm.step()
        assert seq.num_cached_tokens == 32
        assert first == expected and seq.completion_token_ids == expected
    finally:
        llm.exit()


def test_penalties_across_preemption(qwen3_dir, prompts):
    # 12 blocks of 16 tokens cannot hold every sequence: readmitted rows recompute tokens they
    # generated, which must still count as completion tokens
    params = [greedy(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.4)] * len(prompts)
    llm = LLM(qwen3_dir, **{**BASE, "max_model_len": 128}, num_kvcache_blocks=12)
    try:
        ours = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.scheduler.num_preemptions > 0
    finally:
        llm.exit()
    assert ours == [hf_generate(qwen3_dir, q, p) for q, p in zip(prompts, params)]


@pytest.fixture(scope="module")
def early_eos(qwen3_dir, prompts, tmp_path_factory):
    """A copy of the checkpoint whose EOS is the 3rd token greedy picks for ``prompts[4]``,
    and the 5th as a stop token id: without min_tokens both end the completion early."""
    tokens = hf_generate(qwen3_dir, prompts[4], greedy())
    eos, stop = tokens[2], tokens[4]
    assert eos not in tokens[:2] and stop not in tokens[:4] and stop != eos
    path = str(tmp_path_factory.mktemp("early_eos"))
    shutil.copytree(qwen3_dir, path, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        with open(f"{path}/{name}") as f:
            config = json.load(f)
        config["eos_token_id"] = eos
        with open(f"{path}/{name}", "w") as f:
            json.dump(config, f)
    return path, eos, stop


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_min_tokens_holds_back_eos_and_stop_tokens(early_eos, prompts, async_scheduling):
    path, eos, stop = early_eos
    prompt = prompts[4]

    def params(**kw):
        return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, **kw)

    cases = [
        params(),
        params(min_tokens=8),
        params(stop_token_ids=[stop], ignore_eos=True),
        params(stop_token_ids=[stop], ignore_eos=True, min_tokens=10),
        params(stop_token_ids=[stop], min_tokens=10),
    ]
    expected = [hf_generate(path, prompt, p, (eos,)) for p in cases]
    assert len(expected[0]) == 3 and expected[0][-1] == eos
    assert len(expected[2]) == 5 and expected[2][-1] == stop
    assert all(len(expected[i]) >= 8 for i in (1, 3, 4))
    ours = run(path, [prompt] * len(cases), cases, async_scheduling=async_scheduling)
    assert ours == expected
