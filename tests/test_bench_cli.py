"""bench.py's workload, --fresh-prompts, tables, option checks, child processes and random-weight
folder, without building an engine."""

import importlib.util
import os
import subprocess
import sys
from argparse import Namespace
from random import randint, seed

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_cli_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def args(**kw) -> Namespace:
    base = {"num_seqs": 6, "max_input_len": 150, "max_output_len": 120, "runs": 3, "fresh_prompts": False}
    return Namespace(**{**base, **kw})


def original_workload(num_seqs, max_input_len, max_output_len):
    """The workload as bench.py drew it before --fresh-prompts existed."""
    seed(0)
    low_in, low_out = min(100, max_input_len), min(100, max_output_len)
    prompts = [[randint(0, 10000) for _ in range(randint(low_in, max_input_len))] for _ in range(num_seqs)]
    return prompts, [randint(low_out, max_output_len) for _ in range(num_seqs)]


def test_default_workload_unchanged(bench):
    a = args()
    prompts, max_tokens = bench.workload(a)
    assert (prompts, max_tokens) == original_workload(6, 150, 120)
    assert bench.prompts_by_run(a, prompts) == [prompts] * 3


def test_fresh_prompts_differ_by_run_and_keep_lengths(bench):
    a = args(fresh_prompts=True)
    prompts, max_tokens = bench.workload(a)
    runs = bench.prompts_by_run(a, prompts)
    assert len(runs) == 3 and runs[0] == prompts
    for run in runs[1:]:
        assert [len(p) for p in run] == [len(p) for p in prompts]
        assert all(p != q for p, q in zip(run, prompts))
    assert runs[1] != runs[2]
    assert bench.prompts_by_run(a, prompts) == runs  # the same seeds, the same prompts
    assert bench.workload(a) == (prompts, max_tokens)


def test_table_headline_is_run_1(bench, capsys):
    rows = [
        {"engine": "nanovllm", "times": [2.0, 1.0], "tokens": 100},
        {"engine": "vllm", "times": [4.0, 1.0], "tokens": [100, 100]},
    ]
    bench.print_table(rows)
    lines = capsys.readouterr().out.strip().splitlines()
    assert "run 1 time (s)" in lines[0]
    assert lines[2] == "| nanovllm | 2.00 | 50 | 2.00x | - | 100 |"
    assert lines[3] == "| vllm | 4.00 | 25 | 1.00x | - | 100 |"


def test_latency_table(bench, capsys):
    row = {"mode": "latency", "ttft_len": 8192}
    rows = [
        {**row, "engine": "nanovllm", "decode_step_ms": {"1": 5.0, "16": 6.0}, "ttft_ms": 300.0},
        {**row, "engine": "vllm", "decode_step_ms": {"1": 4.0, "16": 6.0}, "ttft_ms": 200.0},
    ]
    bench.print_table(rows)
    out = capsys.readouterr().out
    assert "| decode step, batch 1 (ms) | 5.00 | 4.00 | 1.25x |" in out
    assert "| TTFT, 8,192-token prompt (ms) | 300.00 | 200.00 | 1.50x |" in out


def parsed(bench, monkeypatch, argv: list[str]) -> Namespace:
    monkeypatch.setattr(sys, "argv", ["bench.py", *argv])
    return bench.parse_args()


@pytest.mark.parametrize("only_constrained", [False, True])
def test_structured_children_run_what_the_command_asks(bench, monkeypatch, only_constrained):
    """Every process of a two-engine ``--structured json`` command: the constrained ones really
    constrained (each engine's), the baselines not, each keeping the shared options."""
    argv = ["--engine", "nanovllm,vllm", "--structured", "json", "--shape", "qwen3-8b"]
    argv += ["--only-constrained"] if only_constrained else []
    parent = parsed(bench, monkeypatch, argv)
    children = [
        parsed(bench, monkeypatch, c) for c in bench.child_commands(argv, parent, ["nanovllm", "vllm"])
    ]
    runs = [(c.engine, c.structured) for c in children]
    expected = [
        (e, s) for e in ("nanovllm", "vllm") for s in (["json"] if only_constrained else ["none", "json"])
    ]
    assert runs == expected
    assert all(c.child and c.shape == "qwen3-8b" and c.tokenizer for c in children)
    assert all(c.only_constrained == (c.structured == "json") for c in children)


def test_one_process_per_engine_without_a_constraint(bench, monkeypatch):
    argv = ["--engine", "nanovllm,vllm", "--runs", "2"]
    commands = bench.child_commands(argv, parsed(bench, monkeypatch, argv), ["nanovllm", "vllm"])
    assert [(c.engine, c.runs, c.structured) for c in (parsed(bench, monkeypatch, c) for c in commands)] == [
        ("nanovllm", 2, "none"),
        ("vllm", 2, "none"),
    ]


def test_hf_refuses_latency():
    done = subprocess.run(
        [sys.executable, BENCH, "--engine", "hf", "--latency"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "--latency: the hf engine" in done.stderr


def test_vllm_refill_draws_like_nanovllm():
    """A model named as vLLM names its FP8 MoE parameters gets nanovllm's random recipe: norms and
    scales at 1 (vLLM's dequantization multipliers), every other tensor uniform in +-0.05, float8
    ones included, nothing left at its old values."""
    import torch
    from torch import nn

    from benchmarks.engines import refill_like_nanovllm

    def param(*shape, dtype=torch.bfloat16, value=1e-3):
        return nn.Parameter(torch.full(shape, value).to(dtype), requires_grad=False)

    model = nn.Module()
    model.w13_weight = param(4, 32, 64, dtype=torch.float8_e4m3fn)
    model.w13_weight_scale = param(4, dtype=torch.float32, value=2e-6)
    model.input_layernorm_weight = param(64, value=-1e-3)
    model.gate_weight = param(4, 64)
    refill_like_nanovllm(model)
    for name in ("w13_weight_scale", "input_layernorm_weight"):
        assert torch.equal(getattr(model, name).float(), torch.ones_like(getattr(model, name).float()))
    for name in ("w13_weight", "gate_weight"):
        values = getattr(model, name).float()
        assert values.abs().max() <= 0.0508  # 0.05 rounded up to e4m3 / bf16
        assert values.std() > 0.02 and (values < 0).any() and (values > 0).any()


def test_bench_tokenizer_built_once_then_copied(monkeypatch, tmp_path):
    import tempfile

    from benchmarks.random_checkpoint import copy_bench_tokenizer
    from nanovllm import demo_models

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    built = []

    def fake_build(path, vocab_size):
        built.append(vocab_size)
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            f.write(f"vocab {vocab_size}")
        return vocab_size - 7

    monkeypatch.setattr(demo_models, "write_large_tokenizer", fake_build)
    folders = [tmp_path / f"model{i}" for i in range(3)]
    for folder in folders:
        folder.mkdir()
    eos = [
        copy_bench_tokenizer(str(folders[0]), 4096),
        copy_bench_tokenizer(str(folders[1]), 4096),
    ]
    eos.append(copy_bench_tokenizer(str(folders[2]), 2048))
    assert built == [4096, 2048] and eos == [4089, 4089, 2041]
    assert [sorted(os.listdir(f)) for f in folders] == [["tokenizer.json"]] * 3
    assert (folders[1] / "tokenizer.json").read_text() == "vocab 4096"
    assert (folders[2] / "tokenizer.json").read_text() == "vocab 2048"
