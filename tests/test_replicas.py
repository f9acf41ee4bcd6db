"""Data-parallel replicas on a local Ray instance (CPU): HF's greedy tokens in prompt order,
a dead replica survived, map_batches over a JSONL file, nothing left running after shutdown."""

import json
import os
import signal
import time

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")  # CI installs it

from transformers import AutoTokenizer  # noqa: E402

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.replicas import LLMPredictor, LLMReplicas  # noqa: E402

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=128, kvcache_block_size=16, max_num_seqs=8)
GREEDY = SamplingParams(0.0, 12, True)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def expected(qwen3_dir, prompts, hf_reference):
    return hf_reference(qwen3_dir, prompts, GREEDY.max_tokens) * 2


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(alive(p) for p in pids)


def test_two_replicas_match_one_engine_and_leave_nothing_running(local_ray, qwen3_dir, prompts, expected):
    with LLMReplicas(qwen3_dir, 2, num_cpus_per_replica=1, **OPTIONS) as replicas:
        pids = list(replicas.pids)
        assert len(set(pids)) == 2 and os.getpid() not in pids
        outs = replicas.generate(prompts * 2, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == expected  # prompt order kept
    assert wait_gone(pids)


def test_a_dead_replica_is_reported_and_its_prompts_retried(local_ray, qwen3_dir, prompts, expected):
    with LLMReplicas(qwen3_dir, 2, num_cpus_per_replica=1, **OPTIONS) as replicas:
        os.kill(replicas.pids[0], signal.SIGKILL)  # a crash while the pool is in use
        with pytest.warns(RuntimeWarning, match="replica 0 .* died"):
            outs = replicas.generate(prompts * 2, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outs] == expected
        assert list(replicas.dead) == [0]
        pids = list(replicas.pids)
    assert wait_gone(pids)


def test_map_batches_round_trips_a_jsonl_file(local_ray, qwen3_dir, tmp_path, hf_reference):
    texts = ["The quick brown fox", "Hello, Nano-vLLM.", "Paged attention", "list all prime numbers"]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n" for i, t in enumerate(texts)))
    ds = ray.data.read_json(str(source)).map_batches(
        LLMPredictor,
        fn_constructor_kwargs=dict(model=qwen3_dir, sampling_params=GREEDY, **OPTIONS),
        concurrency=1,
        batch_size=2,
        num_cpus=1,
    )
    ds.write_json(str(tmp_path / "out"))
    files = sorted((tmp_path / "out").iterdir())
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    want = dict(zip(texts, hf_reference(qwen3_dir, [tokenizer.encode(t) for t in texts], GREEDY.max_tokens)))
    assert sorted(r["id"] for r in rows) == list(range(len(texts)))
    for row in rows:
        assert row["generated_token_ids"] == want[row["prompt"]]
        assert row["generated_text"] == tokenizer.decode(want[row["prompt"]], skip_special_tokens=True)


def test_bad_pool_size(local_ray, qwen3_dir):
    with pytest.raises(ValueError, match="num_replicas"):
        LLMReplicas(qwen3_dir, 0, **OPTIONS)
