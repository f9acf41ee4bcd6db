"""Where the bench workload's wall time goes, step by step (CUDA).

    PYTHONPATH=. python3 benchmarks/trace_generate.py [--async-scheduling] [--runs 2]

Runs bench.py's workload like bench.py does and, per timed run, prints: prefill and decode
steps with their wall time, the host time spent launching steps and waiting for tokens,
the slowest steps, and any Triton kernel or torch.compile graph compiled during the run
(a cause of a slow first run).
"""

import argparse
import logging
import tempfile
import time
from collections import defaultdict

import torch

from bench import workload
from nanovllm import LLM, SamplingParams
from nanovllm.demo_models import write_config
from nanovllm.execution.model_runner import SampledTokens

events: list[tuple[float, str]] = []


def note(what: str) -> None:
    events.append((time.perf_counter(), what))


def hook_compiles() -> None:
    try:
        from triton import knobs

        def on_compile(*args, **kwargs):
            fn = kwargs.get("fn")
            note(f"triton compile {getattr(fn, '__name__', fn)} {kwargs.get('key', '')!s:.200}")

        knobs.runtime.jit_post_compile_hook = on_compile
    except (ImportError, AttributeError) as e:
        print(f"no Triton compile hook: {e}")

    class RecordCompiles(logging.Handler):
        def emit(self, record):
            note(f"torch {record.getMessage()[:200]}")

    torch._logging.set_logs(recompiles=True)
    for name in ("torch._dynamo", "torch._inductor"):
        logging.getLogger(name).addHandler(RecordCompiles())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    args = parser.parse_args()
    prompts, max_tokens = workload(args)
    path = tempfile.mkdtemp()
    write_config(path)
    llm = LLM(path, load_format="dummy", max_model_len=4096, async_scheduling=args.async_scheduling)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16), use_tqdm=False)
    hook_compiles()

    host = defaultdict(float)
    original_launch, original_tolist = llm._launch, SampledTokens.tolist

    def launch(step):
        start = time.perf_counter()
        original_launch(step)
        batch = step.batch
        kind = "prefill" if batch.is_prefill else ("ahead" if batch.previous_sample_rows else "decode")
        host[f"launch {kind}"] += time.perf_counter() - start
        host[f"# {kind} launches"] += 1

    def tolist(self):
        start = time.perf_counter()
        out = original_tolist(self)
        host["wait for tokens"] += time.perf_counter() - start
        return out

    llm._launch = launch
    SampledTokens.tolist = tolist
    original_step = llm.step
    steps: list[tuple[float, int]] = []

    def step():
        start = time.perf_counter()
        out = original_step()
        steps.append((time.perf_counter() - start, out.num_prefill_tokens or -out.num_decode_tokens))
        return out

    llm.step = step
    for run in range(1, args.runs + 1):
        steps.clear()
        host.clear()
        events.clear()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        prefill = [t for t, n in steps if n > 0]
        decode = [t for t, n in steps if n <= 0]
        print(f"\n== run {run}: {wall:.2f} s, {sum(max_tokens) / wall:,.0f} tok/s")
        print(f"KV blocks: {llm.num_kvcache_blocks}, preemptions so far: {llm.scheduler.num_preemptions}")
        print(f"prefill: {len(prefill)} steps, {sum(prefill):.3f} s")
        print(f"decode:  {len(decode)} steps, {sum(decode):.3f} s")
        for k, v in sorted(host.items()):
            print(f"  {k:24s} {v:.3f}" + (" s" if not k.startswith("#") else ""))
        slow = sorted(range(len(steps)), key=lambda i: -steps[i][0])[:8]
        print("slowest steps (index, ms, tokens; negative = decode rows):")
        for i in sorted(slow):
            print(f"  {i:5d} {steps[i][0] * 1e3:8.1f} {steps[i][1]:6d}")
        print(f"compiles during the run: {len(events)}")
        for t, what in events[:30]:
            print(f"  +{t - t0:6.2f} s {what}")
    llm.exit()


if __name__ == "__main__":
    main()
