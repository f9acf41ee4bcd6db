"""An engine's life: exit is idempotent, a with block closes it, dropping it frees it."""

import gc
import os
import time
import weakref

import pytest
import torch

from nanovllm import LLM, SamplingParams

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=128, kvcache_block_size=16, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_dropping_the_last_reference_frees_model_and_cache(qwen3_dir, prompts):
    llm = LLM(qwen3_dir, **OPTIONS)
    llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    runner = llm.executor.runner
    model, cache = weakref.ref(runner.model), weakref.ref(runner.kv_cache.tensor)
    del llm, runner
    gc.collect()
    assert model() is None and cache() is None


def test_with_block_closes_and_exit_is_idempotent(qwen3_dir, prompts):
    with LLM(qwen3_dir, **OPTIONS) as llm:
        assert len(llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]["token_ids"]) == 4
    assert llm.executor is None
    llm.exit()
    llm.exit()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)


def test_engines_created_and_dropped_do_not_pile_up(qwen3_dir, prompts):
    sizes = []
    for _ in range(6):
        llm = LLM(
            qwen3_dir, **{**OPTIONS, "max_num_seqs": 512, "max_model_len": 1024}, kv_cache_memory_gb=0.25
        )
        cache = llm.executor.runner.kv_cache.tensor
        assert cache.numel() * cache.element_size() == 2**28
        cache.fill_(1.0)  # make the cache resident
        del cache
        llm.generate(prompts[:2], GREEDY, use_tqdm=False)
        del llm
        gc.collect()
        sizes.append(rss_mib())
    # one engine's cache is 256 MiB: five more engines must not have kept theirs
    assert sizes[-1] - sizes[0] < 128, sizes


def test_example_runs_and_leaves_no_temporary_folder(tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.getcwd()}
    res = subprocess.run(
        [sys.executable, "example.py", "--model", str(tmp_path / "absent"), "--max-tokens", "4"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("Completion:") == 2
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "device, phases",
    [
        ("cpu", ["device", "load", "buffers", "profile", "kv_cache"]),
        pytest.param(
            "cuda",
            ["device", "load", "buffers", "profile", "kv_cache", "warm_up", "graphs"],
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
def test_start_up_is_broken_down_by_phase(qwen3_dir, device, phases):
    """Each phase of the start-up is timed once, in order, and together they take no longer than
    the whole ``LLM()`` call."""
    start = time.perf_counter()
    with LLM(qwen3_dir, **{**OPTIONS, "device": device}) as llm:
        wall = time.perf_counter() - start
        seconds = llm.executor.startup_seconds
    assert list(seconds) == phases
    assert all(s >= 0 for s in seconds.values()) and sum(seconds.values()) <= wall


def test_start_up_objects_are_frozen_until_the_engine_goes(qwen3_dir, prompts):
    """Once started, the garbage collector no longer walks what start-up made (torch, the model:
    a full collection mid-run would stall the step loop); exit gives those objects back."""
    gc.unfreeze()
    with LLM(qwen3_dir, **OPTIONS) as llm:
        assert gc.get_freeze_count() > 10_000
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert gc.get_freeze_count() == 0
