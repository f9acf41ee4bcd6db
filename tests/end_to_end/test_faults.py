"""Faults with tensor parallelism on CPU (gloo): every case ends in a clear error within seconds
and, where the engine survives, in a correct generate; nothing is left running or allocated."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.execution.model_runner import PendingOutput

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
OPTIONS = dict(device="cpu", dtype="float32", max_model_len=128, kvcache_block_size=16, max_num_seqs=4)
TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, tensor_parallel_size=2, worker_timeout_s=TIMEOUT_S, **OPTIONS)
    yield engine
    engine.exit()


@pytest.fixture
def check_whole(llm, prompts, hf_reference, qwen3_dir):
    """``check_whole()``: every block is free, and the next generate equals HF."""

    def check() -> None:
        assert llm.is_finished() and llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks
        outs = llm.generate(prompts[:4], GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outs] == hf_reference(qwen3_dir, prompts[:4], 8)

    return check


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.executor.procs]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def raise_on_call(monkeypatch, obj, name: str, nth: int, error: BaseException) -> None:
    original, calls = getattr(obj, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            raise error
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)


@pytest.mark.parametrize("stage", ["schedule", "read back", "postprocess"])
def test_ctrl_c_between_collectives_needs_no_restart(llm, prompts, check_whole, monkeypatch, stage):
    pids = worker_pids(llm)
    with monkeypatch.context() as m:
        if stage == "schedule":  # planning a step, with a step in flight or not
            raise_on_call(m, llm.scheduler, "_plan", 3, KeyboardInterrupt())
        elif stage == "read back":
            raise_on_call(m, PendingOutput, "result", 3, KeyboardInterrupt())
        else:
            raise_on_call(m, llm.scheduler, "update_from_output", 3, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.executor.broken and worker_pids(llm) == pids
    check_whole()


def test_ctrl_c_inside_a_step_waits_for_the_step_on_every_rank(llm, prompts, check_whole, monkeypatch):
    pids = worker_pids(llm)
    layer = llm.executor.runner.model.model.layers[1].mlp
    forward, calls = layer.forward, [0]

    def interrupted_forward(x):
        calls[0] += 1
        if calls[0] == 3:  # a real SIGINT, mid-step, between two collectives of rank 0
            os.kill(os.getpid(), signal.SIGINT)
        return forward(x)

    monkeypatch.setattr(layer, "forward", interrupted_forward)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert calls[0] >= 3 and not llm.executor.broken and worker_pids(llm) == pids
    check_whole()


def test_an_error_inside_a_step_restarts_the_workers(llm, prompts, check_whole, monkeypatch):
    pids = worker_pids(llm)
    raise_on_call(
        monkeypatch, llm.executor.runner.model.model.layers[0].mlp, "forward", 2, ValueError("boom")
    )
    with pytest.raises(ValueError, match="boom"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    check_whole()
    assert worker_pids(llm) != pids and all(gone(pid) for pid in pids)


def test_a_killed_worker_is_named_at_once_and_replaced(llm, prompts, check_whole):
    proc = llm.executor.procs[0]
    proc.kill()
    proc.join()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker 1 died"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 2
    check_whole()


@pytest.mark.parametrize("when", ["idle", "inside a step"])
def test_a_stopped_worker_is_named_within_the_timeout(llm, prompts, check_whole, monkeypatch, when):
    pid = worker_pids(llm)[0]
    if when == "idle":
        os.kill(pid, signal.SIGSTOP)
    else:  # stop it while rank 0 is in the middle of a step
        layer = llm.executor.runner.model.model.layers[1].mlp
        forward = layer.forward

        def stopping_forward(x):
            os.kill(pid, signal.SIGSTOP)
            return forward(x)

        monkeypatch.setattr(layer, "forward", stopping_forward)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=f"worker 1 \\(pid {pid}\\) is stopped"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < TIMEOUT_S + 2
    finally:
        monkeypatch.undo()
    check_whole()
    assert gone(pid)


# ------------------------------------------------------------------- whole driver processes


def shm_entries() -> set[str]:
    """Shared-memory segments and named semaphores, and our temporary files."""
    tmp = {f"/tmp/{n}" for n in os.listdir("/tmp") if n.startswith("nanovllm")}
    return set(os.listdir("/dev/shm")) | tmp


DRIVER = """
import sys, time
from nanovllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=128,
              kvcache_block_size=16, max_num_seqs=4)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    print("READY", llm.executor.procs[0].pid, flush=True)
    if sys.argv[2] == "idle":
        time.sleep(600)
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    try:
        while True:
            llm.generate(prompts * 2, long, use_tqdm=False)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    again = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    print("SAME" if again == first else f"DIFFERENT {first} {again}", llm.executor.procs[0].pid, flush=True)
    llm.exit()
"""


def start_driver(tmp_path, qwen3_dir: str, mode: str) -> tuple[subprocess.Popen, int]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, str(script), qwen3_dir, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    line = proc.stdout.readline()
    assert line.startswith("READY"), line + proc.stderr.read()
    return proc, int(line.split()[1])


def test_ctrl_c_to_the_whole_job_interrupts_the_call_only(tmp_path, qwen3_dir):
    proc, worker = start_driver(tmp_path, qwen3_dir, "generate")
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: driver and worker get it
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert out.split("\n")[0] == "INTERRUPTED"
    assert out.split("\n")[1] == f"SAME {worker}", out  # the same worker, still in step


@pytest.mark.parametrize("mode", ["idle", "generate"])
def test_a_killed_driver_leaves_nothing_behind(tmp_path, qwen3_dir, mode):
    before = shm_entries()
    proc, worker = start_driver(tmp_path, qwen3_dir, mode)
    time.sleep(0.5)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while not (gone(worker) and shm_entries() <= before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(worker), "the worker outlived its driver"
    assert shm_entries() <= before, shm_entries() - before


def run_script(path, source: str, timeout: float) -> subprocess.CompletedProcess:
    """Write ``source`` (dedented) to ``path`` and run it as a script of its own."""
    path.write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_a_script_without_main_guard_fails_fast_with_the_fix(tmp_path, qwen3_dir):
    before = shm_entries()
    start = time.monotonic()
    source = f"""
        from nanovllm import LLM
        llm = LLM({qwen3_dir!r}, tensor_parallel_size=2, device="cpu", max_model_len=128)
        print("created")
        """
    res = run_script(tmp_path / "no_guard.py", source, timeout=120)
    assert res.returncode != 0 and "created" not in res.stdout
    assert 'if __name__ == "__main__":' in res.stderr, res.stderr[-3000:]
    assert time.monotonic() - start < 60
    assert shm_entries() <= before


def test_a_failed_start_leaves_the_process_free_for_the_next_engine(tmp_path, qwen3_dir):
    """Rank 0 fails to build its model after joining the process group (workers started): the
    group and the workers go with the error, and the next tensor-parallel engine starts."""
    source = f"""
        import torch.distributed as dist
        from nanovllm import LLM, SamplingParams
        from nanovllm.execution import model_runner

        def main():
            build = model_runner.build_model
            def broken(*args, **kwargs):
                raise RuntimeError("no weights today")
            model_runner.build_model = broken
            try:
                LLM({qwen3_dir!r}, tensor_parallel_size=2, device="cpu", max_model_len=128)
            except RuntimeError as exc:
                print("refused:", exc)
            print("group left:", dist.is_initialized())
            model_runner.build_model = build
            with LLM({qwen3_dir!r}, tensor_parallel_size=2, device="cpu", max_model_len=128) as llm:
                out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
                print("generated:", len(out[0].outputs[0].token_ids))

        if __name__ == "__main__":
            main()
        """
    res = run_script(tmp_path / "failed_start.py", source, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "refused: no weights today" in res.stdout
    assert "group left: False" in res.stdout and "generated: 4" in res.stdout
