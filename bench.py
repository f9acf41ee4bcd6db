"""Throughput benchmark: the nano-vllm / vLLM workload, for nanovllm, vLLM or HF transformers.

    python bench.py                                  # nanovllm, Qwen3-0.6B shape, random weights
    python bench.py --engine nanovllm,vllm,hf        # each engine in its own process, one table
    python bench.py --num-seqs 8 --max-input-len 64 --max-output-len 16   # small, e.g. on CPU
    python bench.py --engine nanovllm,vllm --structured json   # JSON-schema outputs vs none
    python bench.py --engine nanovllm,vllm --runs 3 --fresh-prompts   # new prompts each run
    python bench.py --engine nanovllm,vllm --latency   # ms per decode step, time to first token

Workload (as nano-vllm's bench): ``random.seed(0)``; ``num_seqs`` prompts of
``randint(100, max_input_len)`` random token ids in ``[0, 10000]``, then per request
``max_tokens = randint(100, max_output_len)``; temperature 0.6, EOS ignored. One short
warm-up generate, then timed runs; throughput = output tokens / wall time (for nanovllm and
vLLM the tokens the completions hold, which is ``sum(max_tokens)`` when EOS is ignored; for hf
``sum(max_tokens)``).

Random weights (a shape's config without a checkpoint) are drawn by nanovllm's recipe in both
engines: vLLM loads with ``load_format="dummy"`` and its weights are then refilled
(``benchmarks.engines.refill_like_nanovllm``), since its own draw leaves a mixture of experts'
router near-equal logits and its steps then read far fewer experts than a real model's.

The headline is run 1: the table's time and throughput (and the ratios) are run 1's, the first
timed run after the warm-up; the later runs' throughputs follow in their own column, and each
``--json`` row starts with ``run1_time_s`` and ``run1_output_tok_s`` before the list of times.

``--fresh-prompts``: every timed run gets new prompts of the same lengths (with the same
``max_tokens``): run 1 has the workload's prompts, run r > 1 the same lengths filled again after
``random.seed(r - 1)``, so repeated runs measure the engine rather than the prefix cache
(nanovllm and vLLM; hf, without a prefix cache, repeats run 1's prompts). Off by default: then
every run repeats the same prompts.

``--latency`` (nanovllm and vLLM; hf refuses): instead of the workload, (a) milliseconds per
decode step at batch 1, 16 and 64 (``--latency-batches``): B requests of a 512-token prompt
(``--latency-prompt-len``, random ids) each generating 256 tokens (``--latency-decode-tokens``)
with EOS ignored; the wall time of that generate minus the time of the same requests with
``max_tokens=1`` (the prefill), divided by the 255 decode steps; (b) time to first token of one
8,192-token prompt (``--latency-ttft-len``): the wall time of a generate with ``max_tokens=1``.
Each figure is the median of ``--latency-repeats`` repeats (each with new random prompts, so
the prefix cache never hits) after a warm-up of every shape; ``max_model_len`` is the longer
prompt plus the decode tokens. A small table gives one column per engine, with nanovllm's time
over vLLM's when both ran. On CPU, a dry run:
``python bench.py --latency --latency-prompt-len 16 --latency-ttft-len 64 --latency-batches 1,2
--latency-decode-tokens 8 --latency-repeats 1``.

Structured outputs, ``--structured json``: every request's completion must be a JSON record of
``JSON_SCHEMA`` (vLLM's ``StructuredOutputsParams(json=JSON_SCHEMA)``, nanovllm and vLLM; hf
refuses). The random-weight folder then gets a byte-level BPE tokenizer that fills the shape's
151,936 logits (``nanovllm.demo_models.write_large_tokenizer``; the config's EOS is its
"<|im_end|>"), and each engine runs twice, each time in its own process on such a folder
(fresh engine, empty prefix cache): the workload as above (constraint "none", the baseline),
then constrained ("json"); the table's "vs none" is the constrained throughput over the
baseline's. The two compare the same prompts and ``max_tokens``, both without detokenization
(the checks below decode afterwards); constrained requests do not ignore EOS, so a completion
ends ("stop") once its record is complete (with random weights a string rarely closes, so
nearly all run to ``max_tokens``). The constrained warm-up has one constrained request, so the
schema's compilation is not timed. After the timed runs, a line gives the last run's finish
reasons, how many finished records parse with ``json.loads`` and match the schema, and (with
xgrammar) how many completions its matcher accepts token by token.
``--tokenizer`` runs the unconstrained workload alone on a folder with that tokenizer;
``--only-constrained`` runs the constrained one alone (no baseline row).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from random import randint, seed

from benchmarks.engines import ENGINES, LATENCY_ENGINES
from benchmarks.latency import latency_batches, print_latency_table
from benchmarks.random_checkpoint import model_dir
from benchmarks.structured_workload import check_json_outputs
from nanovllm.demo_models import SHAPES


def workload(args) -> tuple[list[list[int]], list[int]]:
    seed(0)
    low_in, low_out = min(100, args.max_input_len), min(100, args.max_output_len)
    prompts = [
        [randint(0, 10000) for _ in range(randint(low_in, args.max_input_len))] for _ in range(args.num_seqs)
    ]
    max_tokens = [randint(low_out, args.max_output_len) for _ in range(args.num_seqs)]
    return prompts, max_tokens


def fresh_prompts(prompts: list[list[int]], run: int) -> list[list[int]]:
    """Run ``run``'s prompts (counted from 0) under ``--fresh-prompts``: run 0 keeps the
    workload's, run r > 0 gets the same lengths filled again with ids drawn after ``seed(r)``."""
    if run == 0:
        return prompts
    seed(run)
    return [[randint(0, 10000) for _ in p] for p in prompts]


def prompts_by_run(args, prompts: list[list[int]]) -> list[list[list[int]]]:
    """Each timed run's prompts: the workload's every time, or fresh ones with ``--fresh-prompts``."""
    if not args.fresh_prompts:
        return [prompts] * args.runs
    return [fresh_prompts(prompts, r) for r in range(args.runs)]


def child_argv(argv: list[str], per_child: tuple[str, ...], flags: tuple[str, ...]) -> list[str]:
    """The command line without the options (with a value) and flags set per child."""
    out, skip = [], False
    for a in argv:
        if skip or a.startswith(tuple(f"{name}=" for name in per_child)) or a in flags:
            skip = False
            continue
        skip = a in per_child
        if not skip:
            out.append(a)
    return out


def child_commands(argv: list[str], args, engines: list[str]) -> list[list[str]]:
    """Each process's command line (``argv`` is the parent's): one per engine, or with
    ``--structured`` a constrained one per engine, after its unconstrained baseline unless
    ``--only-constrained``. Every child gets the parent's options but those set per child."""
    common = child_argv(
        argv, ("--engine", "--json", "--structured"), ("--tokenizer", "--only-constrained", "--child")
    )
    jobs = [[]]
    if args.structured != "none":
        constrained = ["--structured", args.structured, "--only-constrained"]
        jobs = (
            [constrained] if args.only_constrained else [["--structured", "none", "--tokenizer"], constrained]
        )
    return [["--engine", e, "--child", *options, *common] for e in engines for options in jobs]


def parse_args() -> argparse.Namespace:
    """The command line, checked: an option no chosen engine supports is an error."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", default="nanovllm", help="nanovllm, vllm, hf, or a comma-separated list")
    parser.add_argument("--model", default=None, help="model folder (default: random Qwen3 weights)")
    parser.add_argument(
        "--shape",
        default="qwen3-0.6b",
        choices=sorted(SHAPES),
        help="model shape for random weights",
    )
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=1, help="timed runs after the warm-up")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", help='"auto" or "fp8" (nanovllm and vLLM)')
    parser.add_argument(
        "--quantization", default=None, help='None or "fp8": weights in float8 (nanovllm and vLLM)'
    )
    parser.add_argument(
        "--fp8-checkpoint",
        action="store_true",
        help="random weights of an FP8 checkpoint with 128 x 128 block scales (nanovllm and vLLM)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=None, help="running requests at most (default: each engine's own)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens a step computes at most, its prompt chunks included (default: each engine's own)",
    )
    parser.add_argument(
        "--kvcache-block-size",
        type=int,
        default=None,
        help="nanovllm: tokens per KV block (default: 128, or 256 with flash-attn)",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="nanovllm: plan each step while the previous one runs (default on)",
    )
    parser.add_argument(
        "--mixed-steps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="nanovllm: prompt chunks share steps with decodes (default on)",
    )
    parser.add_argument(
        "--hf-runs", type=int, default=1, help="timed runs for hf, whose run takes minutes on a GPU"
    )
    parser.add_argument(
        "--structured",
        default="none",
        choices=("none", "json"),
        help="json: every completion must be a record of JSON_SCHEMA (nanovllm, vllm); each engine "
        "also runs the unconstrained workload on the same kind of folder, in a process of its own",
    )
    parser.add_argument(
        "--tokenizer",
        action="store_true",
        help="random weights: give the folder a BPE tokenizer that fills the logits (as --structured "
        "does; with --structured none, the baseline of a constrained run)",
    )
    parser.add_argument(
        "--only-constrained",
        action="store_true",
        help="with --structured: run the constrained workload only, without the baseline",
    )
    parser.add_argument(
        "--fresh-prompts",
        action="store_true",
        help="every timed run gets new prompts of the same lengths and max_tokens (run r > 1: the "
        "ids drawn again after seed(r - 1)), so repeated runs measure the engine, not the prefix "
        "cache (nanovllm, vllm; hf repeats run 1's prompts); default off: every run repeats them",
    )
    parser.add_argument(
        "--latency",
        action="store_true",
        help="latency mode instead of the workload (nanovllm, vllm): ms per decode step at each "
        "--latency-batches size B, measured as (wall time of a generate of B requests of "
        "--latency-prompt-len random tokens, each making --latency-decode-tokens tokens with EOS "
        "ignored) - (the same with max_tokens=1, the prefill), divided by decode tokens - 1; and "
        "TTFT: the wall time of a max_tokens=1 generate of one --latency-ttft-len-token prompt; "
        "each the median of --latency-repeats after a warm-up, new random prompts every time",
    )
    parser.add_argument("--latency-prompt-len", type=int, default=512, help="--latency: prompt tokens")
    parser.add_argument(
        "--latency-decode-tokens", type=int, default=256, help="--latency: tokens each request makes"
    )
    parser.add_argument(
        "--latency-batches", type=latency_batches, default="1,16,64", help="--latency: batch sizes"
    )
    parser.add_argument(
        "--latency-ttft-len", type=int, default=8192, help="--latency: the TTFT prompt's tokens"
    )
    parser.add_argument("--latency-repeats", type=int, default=3, help="--latency: repeats per figure")
    parser.add_argument("--json", help="append each engine's result as a JSON line to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one of several
    args = parser.parse_args()
    args.tokenizer = args.tokenizer or args.structured != "none"

    engines = args.engine.split(",")
    if unknown := [e for e in engines if e not in ENGINES]:
        parser.error(f"unknown engine(s) {unknown}; choose from {list(ENGINES)}")
    if (args.quantization or args.fp8_checkpoint) and "hf" in engines:
        parser.error("--quantization: the hf engine runs the checkpoint's dtype (use nanovllm and/or vllm)")
    if args.fp8_checkpoint and (args.model or args.quantization):
        parser.error("--fp8-checkpoint writes its own random-weight checkpoint: no --model or --quantization")
    if args.structured != "none" and "hf" in engines:
        parser.error("--structured: the hf engine has no structured outputs (use nanovllm and/or vllm)")
    if args.latency:
        if "hf" in engines:
            parser.error("--latency: the hf engine has no latency mode (use nanovllm and/or vllm)")
        if args.structured != "none" or args.fresh_prompts:
            parser.error("--latency measures its own requests: no --structured or --fresh-prompts")
        if args.latency_decode_tokens < 2 or min(args.latency_prompt_len, args.latency_ttft_len) < 1:
            parser.error("--latency: at least 2 decode tokens and 1 prompt token")
        if args.latency_repeats < 1:
            parser.error("--latency-repeats: at least 1")
    return args


def main() -> None:
    args = parse_args()
    engines = args.engine.split(",")
    commands = child_commands(sys.argv[1:], args, engines)
    if len(commands) > 1:  # one process per run: they must not share a GPU context (or a prefix cache)
        fd, results = tempfile.mkstemp(suffix=".jsonl")
        os.close(fd)
        for command in commands:
            subprocess.run([sys.executable, __file__, "--json", results, *command], check=False)
        with open(results) as f:
            rows = [json.loads(line) for line in f]
        os.unlink(results)
        if args.json:
            with open(args.json, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        print_table(rows)
        return

    if args.latency:
        path, dummy = model_dir(args)
        try:
            row = LATENCY_ENGINES[engines[0]](args, path, dummy)
        finally:
            if dummy:
                shutil.rmtree(path, ignore_errors=True)
    else:
        row = run_workload(args, engines[0])
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    if not args.child:
        print_table([row])
    sys.stdout.flush()
    os._exit(0)  # vLLM's shutdown can hang; everything is reported already


def run_workload(args, engine: str) -> dict:
    """One engine's timed runs of the workload, printed run by run; its result row."""
    prompts, max_tokens = workload(args)
    runs_prompts = prompts_by_run(args, prompts)
    path, dummy = model_dir(args)
    label = engine + (f" +{args.structured}" if args.structured != "none" else "")
    try:
        result = ENGINES[engine](args, path, dummy, runs_prompts, max_tokens)
        fresh = ", fresh prompts" if args.fresh_prompts and engine != "hf" else ""
        for i, (t, total) in enumerate(zip(result["times"], result["tokens"]), 1):
            print(
                f"{label} run {i}: {total} output tokens in {t:.2f} s = {total / t:,.0f} tok/s "
                f"({sum(map(len, prompts))} prompt tokens, {len(prompts)} requests{fresh})",
                flush=True,
            )
        if args.structured == "json":
            print(f"{label} (last run): {check_json_outputs(path, result['completions'])}", flush=True)
    finally:
        if dummy:
            shutil.rmtree(path, ignore_errors=True)
    tokens, times = result["tokens"], result["times"]
    row = {
        "engine": engine,
        "run1_time_s": times[0],
        "run1_output_tok_s": tokens[0] / times[0],
        "times": times,
        "tokens": tokens[0] if len(set(tokens)) == 1 else tokens,
    }
    if args.structured != "none":
        row["workload"] = args.structured
    if args.tokenizer:
        row["tokenizer"] = True
    if args.fresh_prompts and engine != "hf":
        row["fresh_prompts"] = True
    return row


def run_throughputs(row: dict) -> list[float]:
    """Output tokens per second of each timed run, run 1 first."""
    tokens = row["tokens"] if isinstance(row["tokens"], list) else [row["tokens"]] * len(row["times"])
    return [n / t for n, t in zip(tokens, row["times"])]


def later_runs(row: dict) -> str:
    return ", ".join(f"{tps:,.0f}" for tps in run_throughputs(row)[1:]) or "-"


def print_table(rows: list[dict]) -> None:
    """The headline table: run 1's time and throughput, ratios of run 1's, later runs after."""
    if any(r.get("mode") == "latency" for r in rows):
        print_latency_table(rows)
        return
    if all(r.get("workload", "none") == "none" for r in rows):
        first = {r["engine"]: run_throughputs(r)[0] for r in rows}
        print(
            "\n| engine | run 1 time (s) | run 1 output tok/s | vs vLLM | vs HF | later runs (tok/s) |"
            "\n| --- | --- | --- | --- | --- | --- |"
        )
        for r in rows:
            tps = first[r["engine"]]
            ratios = [f"{tps / first[b]:.2f}x" if b in first else "-" for b in ("vllm", "hf")]
            print(
                f"| {r['engine']} | {r['times'][0]:.2f} | {tps:,.0f} | {ratios[0]} | {ratios[1]} | "
                f"{later_runs(r)} |"
            )
        return
    first = {(r["engine"], r.get("workload", "none")): run_throughputs(r)[0] for r in rows}
    print(
        "\n| engine | constraint | run 1 time (s) | run 1 output tok/s | vs none | vs vLLM | vs HF "
        "| later runs (tok/s) |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for r in rows:
        workload = r.get("workload", "none")
        tps = first[r["engine"], workload]
        ratios = [
            f"{tps / first[key]:.2f}x" if key in first else "-"
            for key in ((r["engine"], "none"), ("vllm", workload), ("hf", workload))
        ]
        print(
            f"| {r['engine']} | {workload} | {r['times'][0]:.2f} | {tps:,.0f} | "
            f"{ratios[0]} | {ratios[1]} | {ratios[2]} | {later_runs(r)} |"
        )


if __name__ == "__main__":
    main()
