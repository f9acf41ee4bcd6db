"""Throughput benchmark: the nano-vllm / vLLM workload, for nanovllm, vLLM or HF transformers.

    python bench.py                                  # nanovllm, Qwen3-0.6B shape, random weights
    python bench.py --engine nanovllm,vllm,hf        # each engine in its own process, one table
    python bench.py --num-seqs 8 --max-input-len 64 --max-output-len 16   # small, e.g. on CPU

Workload (as nano-vllm's bench): ``random.seed(0)``; ``num_seqs`` prompts of
``randint(100, max_input_len)`` random token ids in ``[0, 10000]``, then per request
``max_tokens = randint(100, max_output_len)``; temperature 0.6, EOS ignored. One short
warm-up generate, then timed runs; throughput = output tokens / wall time.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from random import randint, seed

from nanovllm.demo_models import SHAPES


def workload(args) -> tuple[list[list[int]], list[int]]:
    seed(0)
    low_in, low_out = min(100, args.max_input_len), min(100, args.max_output_len)
    prompts = [
        [randint(0, 10000) for _ in range(randint(low_in, args.max_input_len))] for _ in range(args.num_seqs)
    ]
    max_tokens = [randint(low_out, args.max_output_len) for _ in range(args.num_seqs)]
    return prompts, max_tokens


def model_dir(args) -> tuple[str, bool]:
    """The checkpoint to use, and whether it is a config-only folder (random weights)."""
    if args.model:
        return os.path.expanduser(args.model), False
    from nanovllm.demo_models import write_config

    path = tempfile.mkdtemp(prefix="nanovllm-bench-")
    write_config(path, args.shape)
    return path, True


def given_options(args, *names: str) -> dict:
    """The named engine options the command line sets (the rest keep each engine's default)."""
    return {name: getattr(args, name) for name in names if getattr(args, name)}


def run_nanovllm(args, path, dummy, prompts, max_tokens) -> list[float]:
    from nanovllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        path,
        load_format="dummy" if dummy else "auto",
        enforce_eager=args.enforce_eager,
        max_model_len=4096,
        tensor_parallel_size=args.tp,
        attention_backend=args.attention_backend,
        async_scheduling=args.async_scheduling,
        mixed_steps=args.mixed_steps,
        kv_cache_dtype=args.kv_cache_dtype,
        **given_options(args, "max_num_seqs", "kvcache_block_size"),
    )
    print(f"nanovllm start-up: {time.perf_counter() - start:.1f} s", flush=True)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16), use_tqdm=False)
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    llm.exit()
    return times


def run_vllm(args, path, dummy, prompts, max_tokens) -> list[float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(
        path,
        load_format="dummy" if dummy else "auto",
        skip_tokenizer_init=dummy,
        max_model_len=4096,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tp,
        kv_cache_dtype=args.kv_cache_dtype,
        **given_options(args, "max_num_seqs"),
    )
    print(f"vllm start-up: {time.perf_counter() - start:.1f} s", flush=True)
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, detokenize=False) for n in max_tokens
    ]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(
        [TokensPrompt(prompt_token_ids=[1, 2, 3, 4])],
        SamplingParams(max_tokens=16, detokenize=False),
        use_tqdm=False,
    )
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return times


def run_hf(args, path, dummy, prompts, max_tokens) -> list[float]:
    """Static batching with ``generate`` (left padding, sdpa): the baseline without paging."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if dummy:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device).eval()
    config = GenerationConfig(
        do_sample=True,
        temperature=0.6,
        top_k=0,
        top_p=1.0,
        eos_token_id=None,
        pad_token_id=0,
        max_new_tokens=max(max_tokens),
    )
    model.generation_config.eos_token_id = None
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        model.generate(
            ids[:1, -4:],
            attention_mask=mask[:1, -4:],
            generation_config=GenerationConfig(
                do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0
            ),
        )
        times = []
        for _ in range(args.hf_runs):
            start = time.perf_counter()
            model.generate(ids, attention_mask=mask, generation_config=config)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return times


ENGINES = {"nanovllm": run_nanovllm, "vllm": run_vllm, "hf": run_hf}


def main() -> None:
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
        "--max-num-seqs", type=int, default=None, help="running requests at most (default: each engine's own)"
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
    parser.add_argument("--json", help="append each engine's result as a JSON line to this file")
    args = parser.parse_args()

    engines = args.engine.split(",")
    if unknown := [e for e in engines if e not in ENGINES]:
        parser.error(f"unknown engine(s) {unknown}; choose from {list(ENGINES)}")
    if len(engines) > 1:  # one process per engine: they must not share a GPU context
        fd, results = tempfile.mkstemp(suffix=".jsonl")
        os.close(fd)
        # the children get every option but --engine and --json, which are set per child
        argv, skip = [], False
        for a in sys.argv[1:]:
            if skip or a.startswith(("--engine=", "--json=")):
                skip = False
                continue
            skip = a in ("--engine", "--json")
            if not skip:
                argv.append(a)
        for engine in engines:
            subprocess.run(
                [sys.executable, __file__, "--engine", engine, "--json", results, *argv], check=False
            )
        with open(results) as f:
            rows = [json.loads(line) for line in f]
        os.unlink(results)
        if args.json:
            with open(args.json, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        print_table(rows)
        return

    prompts, max_tokens = workload(args)
    path, dummy = model_dir(args)
    try:
        times = ENGINES[engines[0]](args, path, dummy, prompts, max_tokens)
    finally:
        if dummy:
            shutil.rmtree(path, ignore_errors=True)
    total = sum(max_tokens)
    for i, t in enumerate(times, 1):
        print(
            f"{engines[0]} run {i}: {total} output tokens in {t:.2f} s = {total / t:,.0f} tok/s "
            f"({sum(map(len, prompts))} prompt tokens, {len(prompts)} requests)",
            flush=True,
        )
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"engine": engines[0], "times": times, "tokens": total}) + "\n")
    sys.stdout.flush()
    os._exit(0)  # vLLM's shutdown can hang; everything is reported already


def print_table(rows: list[dict]) -> None:
    best = {r["engine"]: r["tokens"] / min(r["times"]) for r in rows}
    print("\n| engine | best time (s) | output tok/s | vs vLLM | vs HF |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        tps = best[r["engine"]]
        ratios = [f"{tps / best[b]:.2f}x" if b in best else "-" for b in ("vllm", "hf")]
        print(f"| {r['engine']} | {min(r['times']):.2f} | {tps:,.0f} | {ratios[0]} | {ratios[1]} |")


if __name__ == "__main__":
    main()
