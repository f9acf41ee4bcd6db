"""bench.py's ``--latency`` mode: ms per decode step at a few batch sizes and the time to first
token of one long prompt, measured the same way for each engine, and their table."""

import argparse
import time
from random import Random
from statistics import median


def latency_batches(text: str) -> list[int]:
    batches = [int(b) for b in text.split(",") if b.strip()]
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return batches


def measure_latency(args, engine: str, generate) -> dict:
    """Decode-step time per batch size and time to first token (see the module docstring).
    ``generate(prompts, max_tokens)`` runs one generate with EOS ignored and returns the number
    of output tokens; every call gets new random prompts, so the prefix cache never hits."""
    rng = Random(1234)
    prompt_len, steps = args.latency_prompt_len, args.latency_decode_tokens

    def timed(batch: int, length: int, max_tokens: int) -> float:
        prompts = [[rng.randint(0, 10000) for _ in range(length)] for _ in range(batch)]
        start = time.perf_counter()
        produced = generate(prompts, max_tokens)
        elapsed = time.perf_counter() - start
        if produced != batch * max_tokens:
            raise RuntimeError(f"{engine}: {produced} output tokens, expected {batch} x {max_tokens}")
        return elapsed

    for batch in args.latency_batches:  # warm-up: every shape once
        timed(batch, prompt_len, 1)
        timed(batch, prompt_len, steps)
    timed(1, args.latency_ttft_len, 1)
    decode_ms = {}
    for batch in args.latency_batches:
        full, prefill = [], []
        for _ in range(args.latency_repeats):
            full.append(timed(batch, prompt_len, steps))
            prefill.append(timed(batch, prompt_len, 1))
        ms = (median(full) - median(prefill)) / (steps - 1) * 1000
        decode_ms[str(batch)] = ms
        print(
            f"{engine} decode step, batch {batch}: {ms:.2f} ms = (generate {median(full) * 1000:.1f} ms "
            f"- prefill {median(prefill) * 1000:.1f} ms) / {steps - 1} steps "
            f"({prompt_len}-token prompts, median of {args.latency_repeats})",
            flush=True,
        )
    ttft_ms = median(timed(1, args.latency_ttft_len, 1) for _ in range(args.latency_repeats)) * 1000
    print(
        f"{engine} TTFT, {args.latency_ttft_len:,}-token prompt: {ttft_ms:.1f} ms "
        f"(median of {args.latency_repeats})",
        flush=True,
    )
    return {
        "engine": engine,
        "mode": "latency",
        "decode_step_ms": decode_ms,
        "ttft_ms": ttft_ms,
        "prompt_len": prompt_len,
        "decode_tokens": steps,
        "ttft_len": args.latency_ttft_len,
        "repeats": args.latency_repeats,
    }


def print_latency_table(rows: list[dict]) -> None:
    """One column per engine; with nanovllm and vLLM both, nanovllm's time over vLLM's."""
    by_engine = {r["engine"]: r for r in rows if r.get("mode") == "latency"}
    engines = list(by_engine)
    ratio = "nanovllm" in by_engine and "vllm" in by_engine
    figures = []  # (label, value per engine)
    batches = dict.fromkeys(b for r in by_engine.values() for b in r["decode_step_ms"])
    for b in batches:
        values = {e: r["decode_step_ms"].get(b) for e, r in by_engine.items()}
        figures.append((f"decode step, batch {b} (ms)", values))
    lengths = sorted({r["ttft_len"] for r in by_engine.values()})
    figures.append(
        (
            f"TTFT, {'/'.join(f'{n:,}' for n in lengths)}-token prompt (ms)",
            {e: r["ttft_ms"] for e, r in by_engine.items()},
        )
    )
    head = ["figure", *engines] + (["nanovllm / vLLM (time)"] if ratio else [])
    print("\n| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for label, values in figures:
        cells = [label] + [f"{values[e]:.2f}" if values[e] is not None else "-" for e in engines]
        if ratio:
            n, v = values["nanovllm"], values["vllm"]
            cells.append(f"{n / v:.2f}x" if n is not None and v else "-")
        print("| " + " | ".join(cells) + " |")
