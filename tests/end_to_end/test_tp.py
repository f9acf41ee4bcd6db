"""Tensor parallelism on CPU (gloo): same greedy tokens, clean exit, clear errors."""

import os
import subprocess
import sys
import textwrap

import pytest

from nanovllm import LLM, SamplingParams
from tests.end_to_end.arrivals import run_with_arrivals
from tests.end_to_end.hf_oracle import check_prompt_logprobs, hf_generate, hf_logprobs, hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
OPTIONS = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16, max_num_seqs=8)


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_tp2_matches_hf_and_cleans_up(qwen3_dir, prompts, hf_reference):
    before = shm_entries()
    llm = LLM(qwen3_dir, tensor_parallel_size=2, **OPTIONS)
    procs = list(llm.executor.procs)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outs] == hf_reference(qwen3_dir, prompts, 16)
        # a second engine (in another process) alive at the same time works too
        script = textwrap.dedent(f"""
            from nanovllm import LLM, SamplingParams
            if __name__ == "__main__":
                llm = LLM({qwen3_dir!r}, tensor_parallel_size=2, **{OPTIONS!r})
                params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
                out = llm.generate([{prompts[3]!r}], params, use_tqdm=False)
                print(out[0]["token_ids"])
                llm.exit()
        """)
        res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.strip().splitlines()[-1] == str(hf_reference(qwen3_dir, prompts, 16)[3])
    finally:
        llm.exit()
    assert all(not p.is_alive() for p in procs)
    assert shm_entries() <= before


def test_tp_must_divide_heads(qwen3_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        LLM(qwen3_dir, tensor_parallel_size=3, **OPTIONS)


def test_dead_worker_raises_instead_of_hanging(qwen3_dir, prompts):
    llm = LLM(qwen3_dir, tensor_parallel_size=2, **OPTIONS)
    try:
        proc = llm.executor.procs[0]
        proc.kill()
        proc.join()
        with pytest.raises(RuntimeError, match="worker 1 died"):
            llm.generate(prompts[:2], GREEDY, use_tqdm=False)
        assert llm.is_finished()  # nothing left half-scheduled
    finally:
        llm.exit()


def test_second_tp_engine_in_one_process_is_refused_clearly(qwen3_dir, prompts, hf_reference):
    llm = LLM(qwen3_dir, tensor_parallel_size=2, **OPTIONS)
    try:
        with pytest.raises(ValueError, match="separate process"):
            LLM(qwen3_dir, tensor_parallel_size=2, **OPTIONS)
        # a single-process engine beside it is fine, and both keep working
        solo = LLM(qwen3_dir, **OPTIONS)
        try:
            expected = hf_reference(qwen3_dir, prompts[:3], 16)
            assert [o["token_ids"] for o in solo.generate(prompts[:3], GREEDY, use_tqdm=False)] == expected
            assert [o["token_ids"] for o in llm.generate(prompts[:3], GREEDY, use_tqdm=False)] == expected
        finally:
            solo.exit()
    finally:
        llm.exit()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_steps_planned_ahead_read_broadcast_samples(qwen3_dir, prompts, hf_reference, async_scheduling):
    """With async scheduling every rank takes a planned step's inputs from the samples rank 0
    broadcast; prompts arriving while others decode make mixed steps planned ahead too."""
    llm = LLM(qwen3_dir, tensor_parallel_size=2, async_scheduling=async_scheduling, **OPTIONS)
    launched = []
    original = llm.executor.launch
    llm.executor.launch = lambda batch: launched.append(batch) or original(batch)
    try:
        seqs, _ = run_with_arrivals(llm, prompts, GREEDY)
        assert [s.completion_token_ids for s in seqs] == hf_reference(qwen3_dir, prompts, 16)
        ahead = [b for b in launched if b.previous_sample_rows]
        assert bool(ahead) == async_scheduling
        assert not async_scheduling or any(not b.is_decode for b in ahead), "no mixed step planned ahead"
    finally:
        llm.exit()


def test_tp2_sampler_features_and_logprobs(qwen3_dir, prompts):
    """Penalties, bias, logprobs and prompt logprobs (whose logits are gathered by every rank)
    with two ranks equal HF: greedy tokens with the same processors, log-softmax values."""
    params = [
        SamplingParams(0.0, 12, True, repetition_penalty=1.3, logprobs=3),
        SamplingParams(0.0, 12, True, logit_bias={7: 3.0}, prompt_logprobs=2),
        SamplingParams(0.0, 12, True, frequency_penalty=1.0, presence_penalty=0.5, prompt_logprobs=1),
    ]
    batch = prompts[4:7]
    with LLM(qwen3_dir, tensor_parallel_size=2, **OPTIONS, max_num_batched_tokens=40) as llm:
        outs = llm.generate(batch, params, use_tqdm=False)
    model = hf_model(qwen3_dir)
    for prompt, p, out in zip(batch, params, outs):
        completion = out.outputs[0]
        assert completion.token_ids == hf_generate(qwen3_dir, prompt, p)
        if p.prompt_logprobs is not None:
            check_prompt_logprobs(model, prompt, out.prompt_logprobs, p.prompt_logprobs)
        if p.logprobs is not None:
            want = hf_logprobs(model, prompt, completion.token_ids)
            for t, (entry, token) in enumerate(zip(completion.logprobs, completion.token_ids)):
                assert set(entry) == set(want[t].topk(p.logprobs).indices.tolist()) | {token}
                assert all(abs(v.logprob - want[t, i].item()) < 1e-4 for i, v in entry.items())
