"""End to end on CPU: greedy tokens equal HF transformers, whatever the engine's options."""

import pytest

from nanovllm import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.end_to_end.arrivals import num_mixed_steps, run_with_arrivals
from tests.end_to_end.hf_oracle import float8_kv_attention

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
BASE = dict(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=16)


def run(model_dir: str, prompts, params=GREEDY, **options) -> tuple[list[list[int]], LLM]:
    llm = LLM(model_dir, **{**BASE, **options})
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o["token_ids"] for o in outs], llm
    finally:
        llm.exit()


@pytest.mark.parametrize("block_size", [16, 32, 256])
def test_greedy_matches_hf(qwen3_dir, prompts, hf_reference, block_size):
    ours, _ = run(qwen3_dir, prompts, kvcache_block_size=block_size)
    assert ours == hf_reference(qwen3_dir, prompts, 24)


def test_single_prompt_matches_hf(qwen3_dir, prompts, hf_reference):
    for p in prompts[2:4]:
        ours, _ = run(qwen3_dir, [p], kvcache_block_size=16)
        assert ours == hf_reference(qwen3_dir, [p], 24)


def test_qwen2_checkpoint_matches_hf(qwen2_dir, prompts, hf_reference):
    ours, _ = run(qwen2_dir, prompts, kvcache_block_size=16)
    assert ours == hf_reference(qwen2_dir, prompts, 24)


def test_chunked_prefill_matches_hf(qwen3_dir, prompts, hf_reference):
    # a budget of 7 tokens splits every prompt longer than that, at chunk ends mid-block
    ours, _ = run(qwen3_dir, prompts, kvcache_block_size=16, max_num_batched_tokens=7)
    assert ours == hf_reference(qwen3_dir, prompts, 24)


def test_prefix_caching_hits_and_keeps_output(qwen3_dir, prompts, hf_reference):
    shared = prompts[-1][:48]
    batch = [shared + [7, 8, 9], shared + [10], shared, shared[:32]]
    expected = hf_reference(qwen3_dir, batch, 24)
    llm = LLM(qwen3_dir, **BASE, kvcache_block_size=16)
    try:
        first = [o["token_ids"] for o in llm.generate(batch[:1], GREEDY, use_tqdm=False)]
        seqs = [llm.add_request(p, GREEDY) for p in batch[1:]]
        while not llm.is_finished():
            llm.step()
        # the second wave reuses the first prompt's computed blocks, a 100% hit included
        assert [s.num_cached_tokens for s in seqs] == [48, 32, 16]
        assert first + [s.completion_token_ids for s in seqs] == expected
    finally:
        llm.exit()


def test_prefix_caching_off_gives_same_tokens(qwen3_dir, prompts, hf_reference):
    ours, _ = run(qwen3_dir, prompts + prompts, kvcache_block_size=16, enable_prefix_caching=False)
    assert ours == hf_reference(qwen3_dir, prompts, 24) * 2


def test_preemption_keeps_output(qwen3_dir, prompts, hf_reference):
    # 12 blocks of 16 tokens cannot hold every sequence at once: decode must preempt
    llm = LLM(qwen3_dir, **{**BASE, "max_model_len": 128}, kvcache_block_size=16, num_kvcache_blocks=12)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.scheduler.num_preemptions > 0
        assert [o["token_ids"] for o in outs] == hf_reference(qwen3_dir, prompts, 24)
        assert llm.scheduler.block_manager.num_free_blocks == 12
    finally:
        llm.exit()


def test_prompt_of_exactly_max_model_len(qwen3_dir, prompts, hf_reference):
    """Refused, as vLLM does: the token it would generate does not fit. One token shorter, it
    gets exactly one."""
    prompt = (prompts[-1] * 2)[:64]
    with pytest.raises(ValueError, match="prompt 0 has 64 tokens: with a token to generate"):
        run(qwen3_dir, [prompt], kvcache_block_size=16, max_model_len=64)
    ours, _ = run(qwen3_dir, [prompt[:63]], kvcache_block_size=16, max_model_len=64)
    assert ours == [hf_reference(qwen3_dir, [prompt[:63]], 1)[0]]


def test_max_num_seqs_not_multiple_of_16(qwen3_dir, prompts, hf_reference):
    ours, _ = run(qwen3_dir, prompts, kvcache_block_size=16, max_num_seqs=3)
    assert ours == hf_reference(qwen3_dir, prompts, 24)


def test_string_prompts_and_text(qwen3_dir):
    llm = LLM(qwen3_dir, **BASE, kvcache_block_size=16)
    try:
        outs = llm.generate(["Hello, Nano-vLLM.", "introduce yourself"], GREEDY, use_tqdm=False)
        for o in outs:
            assert len(o["token_ids"]) == 24
            assert o["text"] == llm.tokenizer.decode(o["token_ids"], skip_special_tokens=True)
    finally:
        llm.exit()


def test_eos_and_stop_tokens_end_generation(qwen3_dir, prompts, hf_reference):
    ref = hf_reference(qwen3_dir, prompts[4:5], 24)[0]
    stop = ref[5]
    first = ref.index(stop)
    ours, _ = run(
        qwen3_dir, prompts[4:5], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop])
    )
    assert ours == [ref[: first + 1]]


def test_seeded_sampling_is_reproducible(qwen3_dir, prompts):
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone, _ = run(qwen3_dir, [prompts[3]], params, kvcache_block_size=16)
    other = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    batch, _ = run(qwen3_dir, [prompts[1], prompts[3]], [other, params], kvcache_block_size=16)
    assert batch[1] == alone[0]


def test_async_scheduling_matches_hf(qwen3_dir, prompts, hf_reference):
    # tight blocks force fallbacks to the synchronous path (preemption) between planned steps
    llm = LLM(
        qwen3_dir,
        **{**BASE, "max_model_len": 128},
        kvcache_block_size=16,
        num_kvcache_blocks=12,
        async_scheduling=True,
    )
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outs] == hf_reference(qwen3_dir, prompts, 24)
        assert llm.scheduler.block_manager.num_free_blocks == 12
    finally:
        llm.exit()


def test_async_scheduling_with_stops_and_seeds(qwen3_dir, prompts, hf_reference):
    """EOS-like stops end sequences while a planned step is in flight; seeded draws must not
    depend on whether a step was planned ahead."""
    ref = hf_reference(qwen3_dir, prompts, 24)
    stop_params = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[r[7]]) for r in ref]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        llm = LLM(qwen3_dir, **BASE, kvcache_block_size=16, async_scheduling=async_scheduling)
        try:
            stops = llm.generate(prompts, stop_params, use_tqdm=False)
            samples = llm.generate(prompts, seeded, use_tqdm=False)
            assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks
        finally:
            llm.exit()
        assert [o["token_ids"] for o in stops] == [r[: r.index(r[7]) + 1] for r in ref]
        results.append([o["token_ids"] for o in samples])
    assert results[0] == results[1]


def test_a_failed_step_leaves_the_engine_whole(qwen3_dir, prompts, hf_reference):
    """An exception out of a step ends that call; every block and row comes back, and the
    next call is correct (the executor's per-row state included)."""
    llm = LLM(qwen3_dir, **{**BASE, "max_model_len": 128}, kvcache_block_size=16, num_kvcache_blocks=20)
    try:
        launch, calls = llm.executor.launch, []

        def failing_launch(batch):
            calls.append(batch)
            if len(calls) == 6:
                raise KeyboardInterrupt
            return launch(batch)

        llm.executor.launch = failing_launch
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.is_finished() and llm.scheduler.block_manager.num_free_blocks == 20
        assert sorted(llm.scheduler.free_slots) == list(range(BASE["max_num_seqs"]))
        outs = llm.generate(prompts[::-1], GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outs] == hf_reference(qwen3_dir, prompts, 24)[::-1]
    finally:
        llm.exit()


def test_step_results_count_only_tokens_kept(qwen3_dir, prompts, hf_reference):
    """With async scheduling a planned-ahead row of a sequence that stopped on the step before
    is computed and dropped: it must not count as decoded (the progress bar's rate)."""
    ref = hf_reference(qwen3_dir, prompts, 24)
    llm = LLM(qwen3_dir, **BASE, kvcache_block_size=16, async_scheduling=True)
    try:
        seqs = [
            llm.add_request(p, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[r[3]]))
            for p, r in zip(prompts, ref)
        ]
        decoded = prefilled = 0
        while not llm.is_finished():
            result = llm.step()
            decoded += result.num_decode_tokens
            prefilled += result.num_prefill_tokens
        assert [s.completion_token_ids for s in seqs] == [r[: r.index(r[3]) + 1] for r in ref]
        # each sequence's first token comes from its prefill, every other one from a decode row
        assert decoded == sum(len(s.completion_token_ids) - 1 for s in seqs)
        assert prefilled == sum(map(len, prompts))
    finally:
        llm.exit()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mixed", [False, True], ids=["split", "mixed"])
def test_mixed_steps_on_and_off_match_hf(qwen3_dir, prompts, hf_reference, mixed, async_scheduling):
    """Prompts arrive while others decode, under a small token budget: with mixed steps
    decodes share steps with prompt chunks, without them they wait; the tokens are HF's."""
    llm = LLM(
        qwen3_dir,
        **BASE,
        kvcache_block_size=16,
        max_num_batched_tokens=20,
        mixed_steps=mixed,
        async_scheduling=async_scheduling,
    )
    try:
        seqs, results = run_with_arrivals(llm, prompts, GREEDY)
        assert [s.completion_token_ids for s in seqs] == hf_reference(qwen3_dir, prompts, 24)
        assert (num_mixed_steps(results) > 0) == mixed
    finally:
        llm.exit()


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 7}], ids=["whole_prompts", "chunked"])
def test_fp8_kv_cache_matches_hf_reading_float8_kv(qwen3_dir, prompts, options):
    """The same greedy tokens as HF whose attention rounds every K and V to e4m3: the cache
    stores and reads float8 as that oracle does, also when a prompt reads cached blocks of an
    earlier one, and when a chunk reads earlier chunks' K/V (a budget of 7 tokens)."""
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa_float8_kv", float8_kv_attention)
    batch = prompts + [p + [1, 2, 3] for p in prompts[3:]]
    expected = hf_greedy(qwen3_dir, batch, 24, attn_implementation="sdpa_float8_kv")
    llm = LLM(qwen3_dir, **{**BASE, "kvcache_block_size": 16, "kv_cache_dtype": "fp8", **options})
    try:
        first = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        # the extended prompts hit the blocks the first call computed: float8 read back
        again = llm.generate(batch[len(prompts) :], GREEDY, use_tqdm=False)
        assert sum(o.num_cached_tokens for o in again) > 0
        assert first + [o["token_ids"] for o in again] == expected
    finally:
        llm.exit()


def test_fp8_kv_cache_keeps_most_greedy_tokens(qwen3_dir, prompts, hf_reference):
    """K/V stored as float8 (scale 1) and read back by the reference attention. On this
    random-weight model, whose logits are nearly flat, 41% of greedy tokens equal HF's fp32
    ones (a bfloat16 model agrees on 73%); a cache read wrongly agrees on next to none."""
    ours, llm = run(qwen3_dir, prompts, kvcache_block_size=16, kv_cache_dtype="fp8")
    assert llm.config.kv_cache_dtype == "fp8"
    expected = hf_reference(qwen3_dir, prompts, 24)
    same = sum(a == b for out, ref in zip(ours, expected) for a, b in zip(out, ref))
    assert same / sum(map(len, expected)) > 0.3
