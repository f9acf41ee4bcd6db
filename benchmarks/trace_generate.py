"""Where the bench workload's wall time goes, step by step (CUDA).

    PYTHONPATH=. python3 benchmarks/trace_generate.py [--shape qwen3-8b --num-seqs 1024] [--runs 2]
                                                   [--fresh-prompts]

Runs bench.py's workload like bench.py does and, per timed run, prints: prefill, mixed and
decode steps with their wall time; the GPU's time from each kind of step's start to its end,
and its idle time before such steps (CUDA events around every launch); the host time spent
launching each kind of step (planned ahead of the step before, or not) and waiting for
tokens; host stalls (waits for a step with none queued behind it, after which the GPU idles
until the host launches the next); the slowest steps; and any Triton kernel or torch.compile
graph compiled during the run (a cause of a slow first run).
"""

import argparse
import logging
import tempfile
import time
from collections import defaultdict, deque

import torch

from bench import prompts_by_run, workload
from benchmarks.engines import given_options
from nanovllm import LLM, SamplingParams
from nanovllm.demo_models import SHAPES, write_config
from nanovllm.engine.executor import Executor, PendingOutput
from nanovllm.scheduling import StepBatch, StepOutput

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


def step_kind(batch: StepBatch) -> str:
    if batch.is_decode:
        return "decode"
    return "mixed" if batch.num_single_token_rows else "prefill"


class TracedOutput:
    """A step's pending output whose read-back is timed."""

    def __init__(self, tracer: "TracingExecutor", pending: PendingOutput):
        self.tracer, self.pending = tracer, pending

    def result(self) -> StepOutput:
        tracer = self.tracer
        tracer.num_in_flight -= 1
        stall = not tracer.num_in_flight  # nothing queued behind this step: the GPU idles after it
        start = time.perf_counter()
        out = self.pending.result()
        key = "wait, stalling" if stall else "wait, overlapped"
        tracer.host[key] += time.perf_counter() - start
        tracer.host[f"# {key}"] += 1
        return out


class TracingExecutor:
    """The engine's executor with each launch and read-back timed on the host, and CUDA events
    around each launch's work: the GPU reaches the first once the step before is done and the
    host has begun this one, so the time between steps is GPU idle."""

    def __init__(self, inner: Executor):
        self.inner = inner
        self.num_kvcache_blocks = inner.num_kvcache_blocks
        self.supports_async_scheduling = inner.supports_async_scheduling
        self.host: defaultdict[str, float] = defaultdict(float)
        self.spans: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.launched: deque[str] = deque()  # kinds of the steps launched, not yet collected
        self.num_in_flight = 0

    def launch(self, batch: StepBatch) -> TracedOutput:
        ahead = " ahead" if self.num_in_flight else ""
        start = time.perf_counter()
        gpu_start, gpu_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gpu_start.record()
        pending = self.inner.launch(batch)
        gpu_end.record()
        kind = step_kind(batch)
        self.spans.append((kind, gpu_start, gpu_end))
        self.launched.append(kind)
        self.num_in_flight += 1
        self.host[f"launch {kind}{ahead}"] += time.perf_counter() - start
        self.host[f"# {kind}{ahead} launches"] += 1
        return TracedOutput(self, pending)

    def recover(self) -> bool:
        return self.inner.recover()

    def close(self) -> None:
        self.inner.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--mixed-steps", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--fresh-prompts", action="store_true", help="as bench.py's: new prompts each run")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="the engine's (default: its own)")
    parser.add_argument("--kvcache-block-size", type=int, default=None, help="tokens per KV block")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens a step at most")
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--quantization", default=None, help='as LLM(quantization=...): "fp8"')
    parser.add_argument("--kv-cache-dtype", default=None, help='as LLM(kv_cache_dtype=...): "fp8"')
    args = parser.parse_args()
    prompts, max_tokens = workload(args)
    path = tempfile.mkdtemp()
    write_config(path, args.shape)
    llm = LLM(
        path,
        load_format="dummy",
        max_model_len=4096,
        async_scheduling=args.async_scheduling,
        mixed_steps=args.mixed_steps,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **given_options(args, "max_num_seqs", "max_num_batched_tokens", "kvcache_block_size"),
        **given_options(args, "quantization", "kv_cache_dtype"),
    )
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16), use_tqdm=False)
    hook_compiles()

    tracer = TracingExecutor(llm.executor)
    llm.executor = tracer
    host, spans = tracer.host, tracer.spans
    steps: list[tuple[float, str, int, int]] = []

    for run, run_prompts in enumerate(prompts_by_run(args, prompts), start=1):
        steps.clear()
        spans.clear()
        host.clear()
        events.clear()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats()
        t0 = time.perf_counter()
        llm.add_requests(run_prompts, params)  # the loop of generate, each step timed
        while not llm.is_finished():
            start = time.perf_counter()
            out = llm.step()
            kind = tracer.launched.popleft()
            steps.append((time.perf_counter() - start, kind, out.num_prefill_tokens, out.num_decode_tokens))
        wall = time.perf_counter() - t0
        after = torch.cuda.memory_stats()
        print(f"\n== run {run}: {wall:.2f} s, {sum(max_tokens) / wall:,.0f} tok/s ({args.shape})")
        print(f"KV blocks: {llm.num_kvcache_blocks}, preemptions so far: {llm.scheduler.num_preemptions}")
        # the caching allocator frees its cache and retries (synchronising the device) when
        # a request does not fit: one per step would stall every step
        counts = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc")}
        print(
            f"allocator: {counts['num_alloc_retries']} retries, {counts['num_device_alloc']} cudaMallocs; "
            f"peak {after['allocated_bytes.all.peak'] / 2**30:.1f} GiB allocated, "
            f"{after['reserved_bytes.all.peak'] / 2**30:.1f} GiB reserved"
        )
        print("step kind   steps  wall (s)  prompt tokens  decode tokens")
        for kind in ("prefill", "mixed", "decode"):
            mine = [s for s in steps if s[1] == kind]
            seconds, prompt, decode = (sum(s[i] for s in mine) for i in (0, 2, 3))
            print(f"  {kind:8s} {len(mine):6d} {seconds:9.3f} {prompt:14,d} {decode:14,d}")
        print("decode steps by rows: rows  steps  wall (s)  ms/step")
        for low, high in ((1, 16), (17, 64), (65, 256), (257, 512), (513, 1 << 30)):
            mine = [s[0] for s in steps if s[1] == "decode" and low <= s[3] <= high]
            if mine:
                label = f"{low}-{high}" if high < 1 << 30 else f"{low}+"
                print(f"  {label:>9s} {len(mine):6d} {sum(mine):9.3f} {1e3 * sum(mine) / len(mine):8.2f}")
        torch.cuda.synchronize()
        gpu_span, idle_before = defaultdict(float), defaultdict(float)
        for i, (kind, gpu_start, gpu_end) in enumerate(spans):
            gpu_span[kind] += gpu_start.elapsed_time(gpu_end) / 1e3
            if i:
                idle_before[kind] += spans[i - 1][2].elapsed_time(gpu_start) / 1e3
        print("GPU, by step kind: from a step's start to its end (s), and idle before its start (s)")
        for kind in sorted(gpu_span):
            print(f"  {kind:8s} {gpu_span[kind]:9.3f} {idle_before[kind]:9.3f}")
        for k, v in sorted(host.items()):
            print(f"  {k:28s} {v:.3f}" + (" s" if not k.startswith("#") else ""))
        slow = sorted(range(len(steps)), key=lambda i: -steps[i][0])[:8]
        print("slowest steps (index, ms, kind, prompt tokens, decode tokens):")
        for i in sorted(slow):
            t, kind, prompt, decode = steps[i]
            print(f"  {i:5d} {t * 1e3:8.1f} {kind:8s} {prompt:6d} {decode:6d}")
        print(f"compiles during the run: {len(events)}")
        for t, what in events[:30]:
            print(f"  +{t - t0:6.2f} s {what}")
    llm.exit()


if __name__ == "__main__":
    main()
