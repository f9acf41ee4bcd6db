"""benchmarks/simulate_schedule.py prices the steps the real scheduler plans: its token
accounting must match the workload it replays."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT))  # the script imports bench.py's workload


def load_simulator():
    path = ROOT / "benchmarks" / "simulate_schedule.py"
    spec = importlib.util.spec_from_file_location("simulate_schedule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def workload_args(cache_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_seqs=40,
        max_input_len=300,
        max_output_len=200,
        cache_tokens=cache_tokens,
        max_num_batched_tokens=512,
    )


def test_every_prompt_token_is_prefilled_once_and_every_later_token_decoded_once():
    sim = load_simulator()
    args = workload_args(cache_tokens=64 * 1024)
    prompts, max_tokens = sim.workload(args)
    r = sim.simulate(args, block_size=16, max_num_seqs=8)
    assert r["preemptions"] == 0
    assert r["prompt tokens"] == sum(map(len, prompts))
    assert r["decode tokens"] == sum(max_tokens) - len(prompts)  # each first token comes from its prompt
    assert r["total"] > 0 and r["mixed steps"] > 0 and r["decode steps"] > 0


def test_a_small_cache_preempts_and_recomputes():
    sim = load_simulator()
    args = workload_args(cache_tokens=1024)
    prompts, _ = sim.workload(args)
    r = sim.simulate(args, block_size=16, max_num_seqs=8)
    assert r["preemptions"] > 0
    assert r["prompt tokens"] > sum(map(len, prompts))
