"""Throughput benchmark: the nano-vllm / vLLM workload, for nanovllm, vLLM or HF transformers.

    python bench.py                                  # nanovllm, Qwen3-0.6B shape, random weights
    python bench.py --engine nanovllm,vllm,hf        # each engine in its own process, one table
    python bench.py --num-seqs 8 --max-input-len 64 --max-output-len 16   # small, e.g. on CPU
    python bench.py --engine nanovllm,vllm --structured json   # JSON-schema outputs vs none

Workload (as nano-vllm's bench): ``random.seed(0)``; ``num_seqs`` prompts of
``randint(100, max_input_len)`` random token ids in ``[0, 10000]``, then per request
``max_tokens = randint(100, max_output_len)``; temperature 0.6, EOS ignored. One short
warm-up generate, then timed runs; throughput = output tokens / wall time (for nanovllm and
vLLM the tokens the completions hold, which is ``sum(max_tokens)`` when EOS is ignored; for hf
``sum(max_tokens)``).

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
import time
from collections import Counter
from random import randint, seed

from nanovllm.demo_models import SHAPES

# An extraction record, as a structured-output request would ask for it.
JSON_SCHEMA = {
    "title": "CustomerTicket",
    "type": "object",
    "properties": {
        "customer_name": {"type": "string"},
        "email": {"type": "string"},
        "product": {"type": "string"},
        "order_id": {"type": "integer"},
        "is_refund_requested": {"type": "boolean"},
        "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]},
        "issues": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": [
        "customer_name",
        "email",
        "product",
        "order_id",
        "is_refund_requested",
        "sentiment",
        "issues",
        "summary",
    ],
    "additionalProperties": False,
}


def workload(args) -> tuple[list[list[int]], list[int]]:
    seed(0)
    low_in, low_out = min(100, args.max_input_len), min(100, args.max_output_len)
    prompts = [
        [randint(0, 10000) for _ in range(randint(low_in, args.max_input_len))] for _ in range(args.num_seqs)
    ]
    max_tokens = [randint(low_out, args.max_output_len) for _ in range(args.num_seqs)]
    return prompts, max_tokens


def model_dir(args) -> tuple[str, bool]:
    """The checkpoint to use, and whether it is a config-only folder (random weights); with
    ``--tokenizer`` (or ``--structured``) the folder also has a tokenizer that fills the logits."""
    if args.model:
        return os.path.expanduser(args.model), False
    from nanovllm.demo_models import write_config

    path = tempfile.mkdtemp(prefix="nanovllm-bench-")
    if args.tokenizer:
        from nanovllm.demo_models import write_large_tokenizer

        start = time.perf_counter()
        eos = write_large_tokenizer(path, SHAPES[args.shape]["vocab_size"])
        print(f"tokenizer: {time.perf_counter() - start:.1f} s", flush=True)
        write_config(path, args.shape, eos_token_id=eos)
    else:
        write_config(path, args.shape)
    return path, True


def given_options(args, *names: str) -> dict:
    """The named engine options the command line sets (the rest keep each engine's default)."""
    return {name: getattr(args, name) for name in names if getattr(args, name)}


def workload_params(args, params_cls, constraint_cls, max_tokens: list[int]) -> list:
    """Each request's sampling parameters (``params_cls``: the engine's ``SamplingParams``,
    ``constraint_cls``: its ``StructuredOutputsParams``)."""
    if args.structured == "json":
        return [
            params_cls(
                temperature=0.6,
                max_tokens=n,
                detokenize=False,
                structured_outputs=constraint_cls(json=JSON_SCHEMA),
            )
            for n in max_tokens
        ]
    plain = {"detokenize": False} if args.tokenizer else {}
    return [params_cls(temperature=0.6, ignore_eos=True, max_tokens=n, **plain) for n in max_tokens]


def completions(outputs) -> list[tuple[str | None, list[int]]]:
    """(finish reason, token ids) of each request's completion (nanovllm's and vLLM's outputs)."""
    return [(o.outputs[0].finish_reason, list(o.outputs[0].token_ids)) for o in outputs]


def run_nanovllm(args, path, dummy, prompts, max_tokens) -> dict:
    from nanovllm import LLM, SamplingParams
    from nanovllm.sampling_params import StructuredOutputsParams

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
        **given_options(args, "max_num_seqs", "kvcache_block_size", "quantization"),
    )
    print(f"nanovllm start-up: {time.perf_counter() - start:.1f} s", flush=True)
    params = workload_params(args, SamplingParams, StructuredOutputsParams, max_tokens)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16), use_tqdm=False)
    if args.structured == "json":
        warm_up = workload_params(args, SamplingParams, StructuredOutputsParams, [16])
        llm.generate([[1, 2, 3, 4]], warm_up, use_tqdm=False)
    times, tokens, outputs = [], [], []
    for _ in range(args.runs):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        tokens.append(sum(len(o.outputs[0].token_ids) for o in outputs))
    llm.exit()
    return {"times": times, "tokens": tokens, "completions": completions(outputs)}


def run_vllm(args, path, dummy, prompts, max_tokens) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    start = time.perf_counter()
    llm = LLM(
        path,
        load_format="dummy" if dummy else "auto",
        skip_tokenizer_init=dummy and not args.tokenizer,  # structured outputs need the tokenizer
        max_model_len=4096,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tp,
        kv_cache_dtype=args.kv_cache_dtype,
        **given_options(args, "max_num_seqs", "quantization"),
    )
    print(f"vllm start-up: {time.perf_counter() - start:.1f} s", flush=True)
    if args.structured == "none":
        params = [
            SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, detokenize=False)
            for n in max_tokens
        ]
    else:
        params = workload_params(args, SamplingParams, StructuredOutputsParams, max_tokens)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    warm_up = [TokensPrompt(prompt_token_ids=[1, 2, 3, 4])]
    llm.generate(warm_up, SamplingParams(max_tokens=16, detokenize=False), use_tqdm=False)
    if args.structured == "json":
        llm.generate(
            warm_up, workload_params(args, SamplingParams, StructuredOutputsParams, [16]), use_tqdm=False
        )
    times, tokens, outputs = [], [], []
    for _ in range(args.runs):
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        tokens.append(sum(len(o.outputs[0].token_ids) for o in outputs))
    return {"times": times, "tokens": tokens, "completions": completions(outputs)}


def run_hf(args, path, dummy, prompts, max_tokens) -> dict:
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
    return {"times": times, "tokens": [sum(max_tokens)] * len(times), "completions": None}


ENGINES = {"nanovllm": run_nanovllm, "vllm": run_vllm, "hf": run_hf}


def matches_schema(value, schema: dict) -> bool:
    """Whether a parsed JSON value satisfies ``schema`` (the keywords ``JSON_SCHEMA`` uses)."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict) or not set(schema.get("required", ())) <= value.keys():
            return False
        properties = schema.get("properties", {})
        if schema.get("additionalProperties") is False and not value.keys() <= properties.keys():
            return False
        return all(matches_schema(v, properties.get(k, {})) for k, v in value.items())
    if kind == "array":
        return isinstance(value, list) and all(matches_schema(v, schema.get("items", {})) for v in value)
    types = {"string": str, "boolean": bool, "integer": int, "number": (int, float)}
    if kind in types and not isinstance(value, types[kind]):
        return False
    return not (kind in ("integer", "number") and isinstance(value, bool))


def check_json_outputs(path: str, results: list[tuple[str | None, list[int]]]) -> str:
    """A line on the constrained completions (not timed): finish reasons, how many finished ones
    parse as records of ``JSON_SCHEMA``, and how many completions xgrammar's matcher accepts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    reasons = Counter(str(reason) for reason, _ in results)
    finished = [ids for reason, ids in results if reason == "stop"]
    valid = 0
    for ids in finished:
        try:
            valid += matches_schema(json.loads(tokenizer.decode(ids, skip_special_tokens=True)), JSON_SCHEMA)
        except ValueError:
            pass
    line = ", ".join(f"{n} {reason}" for reason, n in reasons.most_common())
    line += f"; {valid}/{len(finished)} stopped completions are records of the schema (json.loads)"
    try:
        import xgrammar as xgr
    except ImportError:
        return line + "; xgrammar not installed, no token-level check"
    with open(os.path.join(path, "config.json")) as f:
        vocab_size = json.load(f).get("vocab_size")
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(JSON_SCHEMA)  # vLLM's: any whitespace
    followed = 0
    for _, ids in results:
        matcher = xgr.GrammarMatcher(compiled)
        followed += all(matcher.accept_token(t) for t in ids)
    return line + f"; {followed}/{len(results)} completions follow the schema token by token (xgrammar)"


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
        "--quantization", default=None, help='None or "fp8": weights in float8 (nanovllm and vLLM)'
    )
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
    parser.add_argument("--json", help="append each engine's result as a JSON line to this file")
    args = parser.parse_args()
    args.tokenizer = args.tokenizer or args.structured != "none"

    engines = args.engine.split(",")
    if unknown := [e for e in engines if e not in ENGINES]:
        parser.error(f"unknown engine(s) {unknown}; choose from {list(ENGINES)}")
    if args.quantization and "hf" in engines:
        parser.error("--quantization: the hf engine runs the checkpoint's dtype (use nanovllm and/or vllm)")
    if args.structured != "none" and "hf" in engines:
        parser.error("--structured: the hf engine has no structured outputs (use nanovllm and/or vllm)")
    # (engine, extra options) per process: a constrained run also gets its unconstrained baseline
    jobs = [(e, []) for e in engines]
    if args.structured != "none" and not args.only_constrained:
        jobs = [
            (e, o)
            for e in engines
            for o in (
                ["--structured", "none", "--tokenizer"],
                ["--structured", args.structured, "--only-constrained"],
            )
        ]
    if len(jobs) > 1:  # one process per run: they must not share a GPU context (or a prefix cache)
        fd, results = tempfile.mkstemp(suffix=".jsonl")
        os.close(fd)
        # the children get every option but these, which are set per child
        argv = child_argv(
            sys.argv[1:], ("--engine", "--json", "--structured"), ("--tokenizer", "--only-constrained")
        )
        for engine, options in jobs:
            subprocess.run(
                [sys.executable, __file__, "--engine", engine, "--json", results, *options, *argv],
                check=False,
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
    label = engines[0] + (f" +{args.structured}" if args.structured != "none" else "")
    try:
        result = ENGINES[engines[0]](args, path, dummy, prompts, max_tokens)
        for i, (t, total) in enumerate(zip(result["times"], result["tokens"]), 1):
            print(
                f"{label} run {i}: {total} output tokens in {t:.2f} s = {total / t:,.0f} tok/s "
                f"({sum(map(len, prompts))} prompt tokens, {len(prompts)} requests)",
                flush=True,
            )
        if args.structured == "json":
            print(f"{label} (last run): {check_json_outputs(path, result['completions'])}", flush=True)
    finally:
        if dummy:
            shutil.rmtree(path, ignore_errors=True)
    if args.json:
        tokens = result["tokens"]
        row = {
            "engine": engines[0],
            "times": result["times"],
            "tokens": tokens[0] if len(set(tokens)) == 1 else tokens,
        }
        if args.structured != "none":
            row["workload"] = args.structured
        if args.tokenizer:
            row["tokenizer"] = True
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    sys.stdout.flush()
    os._exit(0)  # vLLM's shutdown can hang; everything is reported already


def best_throughput(row: dict) -> float:
    tokens = row["tokens"] if isinstance(row["tokens"], list) else [row["tokens"]] * len(row["times"])
    return max(n / t for n, t in zip(tokens, row["times"]))


def print_table(rows: list[dict]) -> None:
    if all(r.get("workload", "none") == "none" for r in rows):
        best = {r["engine"]: best_throughput(r) for r in rows}
        print(
            "\n| engine | best time (s) | output tok/s | vs vLLM | vs HF |\n| --- | --- | --- | --- | --- |"
        )
        for r in rows:
            tps = best[r["engine"]]
            ratios = [f"{tps / best[b]:.2f}x" if b in best else "-" for b in ("vllm", "hf")]
            print(f"| {r['engine']} | {min(r['times']):.2f} | {tps:,.0f} | {ratios[0]} | {ratios[1]} |")
        return
    best = {(r["engine"], r.get("workload", "none")): best_throughput(r) for r in rows}
    print(
        "\n| engine | constraint | best time (s) | output tok/s | vs none | vs vLLM | vs HF |"
        "\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    for r in rows:
        workload = r.get("workload", "none")
        tps = best[r["engine"], workload]
        ratios = [
            f"{tps / best[key]:.2f}x" if key in best else "-"
            for key in ((r["engine"], "none"), ("vllm", workload), ("hf", workload))
        ]
        print(
            f"| {r['engine']} | {workload} | {min(r['times']):.2f} | {tps:,.0f} | "
            f"{ratios[0]} | {ratios[1]} | {ratios[2]} |"
        )


if __name__ == "__main__":
    main()
