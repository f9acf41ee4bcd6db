"""Where one decode step's time goes, at batch 256 on a bench-shaped model (CUDA).

    PYTHONPATH=. python3 benchmarks/profile_decode_step.py [--shape qwen3-8b] [--batch 256] [--context 1024]
        [--quantization fp8]

With ``--prompt-tokens N`` every timed step is a mixed one: the decodes plus ``--prompts``
new N-token prompts (requests of one output token, so the batch stays the same size). The
8B bench's prompt steps are about ``--batch 512 --context 600 --prompt-tokens 560 --prompts 29``;
``--batch 1 --context 16 --prompt-tokens 8192`` is close to ``bench.py --latency``'s first token.

Prints wall time per step split into parts (queueing the mixed steps' new prompts, schedule, the
host's launch of the step: inputs, forward and sampling enqueued, the wait for its tokens,
postprocess), the GPU-busy time and the number of kernels per step, and the top CUDA kernels; on
CUDA graphs, then the decode graph replayed alone against the sum of its kernels (the GPU's idle
time between kernels inside a graph). A mixed step's launch is eager: where it takes longer than
the GPU's work, the engine's steps are bound by the host. ``--host-profile`` adds the launch's
Python profile (the functions with the most time of their own, then the most time under them).
``--chrome-trace PATH`` last records ``--trace-steps`` steps of the engine's own loop (planned
ahead, as ``generate`` runs them) as a Chrome trace and prints where the GPU waits between
operations (:mod:`benchmarks.trace_gaps`).
"""

import argparse
import cProfile
import json
import pstats
import random
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.cuda_graphs import replay_ms
from benchmarks.trace_gaps import device_ops, find_gaps
from nanovllm import LLM, SamplingParams
from nanovllm.demo_models import SHAPES, write_config
from nanovllm.scheduling import ScheduledStep


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--quantization", choices=("fp8",), default=None, help="FP8 weights")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="new prompts' length, every step")
    parser.add_argument("--prompts", type=int, default=1, help="new prompts in every step")
    parser.add_argument("--host-profile", action="store_true", help="profile the launches' Python")
    parser.add_argument("--chrome-trace", default=None, help="write a trace of the engine's steps here")
    parser.add_argument("--trace-steps", type=int, default=20, help="steps in the Chrome trace")
    args = parser.parse_args()
    path = tempfile.mkdtemp()
    write_config(path, args.shape)
    llm = LLM(
        path,
        load_format="dummy",
        enforce_eager=args.enforce_eager,
        max_model_len=max(4096, args.context + args.prompt_tokens + 2 * args.steps + 64),
        quantization=args.quantization,
    )
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=10_000)
    for i in range(args.batch):
        llm.add_request([(i * 7 + j) % 10000 for j in range(args.context)], params)
    sched, runner = llm.scheduler, llm.executor.runner
    advance = llm.output_processor.process  # as the engine's step loop: the step, then its output
    rng = random.Random(0)

    def add_prompts() -> None:
        for _ in range(args.prompts if args.prompt_tokens else 0):  # random tokens: no cache hits
            prompt = [rng.randrange(10000) for _ in range(args.prompt_tokens)]
            llm.add_request(prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1))

    def schedule() -> ScheduledStep:
        add_prompts()
        return sched.schedule()

    while True:  # prefill everything
        step = sched.schedule()
        if step.batch.is_decode:
            break
        advance(step, runner.run(step.batch))
    # the last schedule() was a decode; run it, then time steps split by part
    advance(step, runner.run(step.batch))
    torch.cuda.synchronize()
    parts = {"add prompts": 0.0, "schedule": 0.0, "launch (host)": 0.0, "wait": 0.0, "postprocess": 0.0}
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start_ev.record()
    for _ in range(args.steps):
        times = [time.perf_counter()]
        add_prompts()
        times.append(time.perf_counter())
        step = sched.schedule()
        times.append(time.perf_counter())
        pending = runner.launch(step.batch)
        times.append(time.perf_counter())
        tokens = pending.result()
        times.append(time.perf_counter())
        advance(step, tokens)
        times.append(time.perf_counter())
        for k, before, after in zip(parts, times, times[1:]):
            parts[k] += after - before
    end_ev.record()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    kind = f" + {args.prompts} prompts of {args.prompt_tokens} tokens" if args.prompt_tokens else ""
    print(f"batch {args.batch}{kind}, context ~{args.context}: {wall:.3f} ms/step wall")
    for k, v in parts.items():
        print(f"  {k:13s} {v / args.steps * 1e3:.3f} ms")
    if args.host_profile:
        host = cProfile.Profile()
        for _ in range(5):
            step = schedule()
            host.enable()
            pending = runner.launch(step.batch)
            host.disable()
            advance(step, pending.result())
        stats = pstats.Stats(host)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(40)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step = schedule()
            advance(step, runner.run(step.batch))
        torch.cuda.synchronize()
    busy_ms, launches, copies = device_time(prof, 5)
    print(f"GPU busy per step: {busy_ms:.3f} ms (so {wall - busy_ms:.3f} ms/step not overlapped)")
    print(f"kernels per step: {launches:.0f} (and {copies:.0f} copies or fills)")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    if runner.graphs is not None:
        replay_alone(runner.graphs, args.batch)
    if args.chrome_trace:
        trace_engine_steps(llm, add_prompts, args.trace_steps, args.chrome_trace)
    llm.exit()


def trace_engine_steps(llm: LLM, add_prompts, steps: int, path: str) -> None:
    """``steps`` steps of the engine's loop as a Chrome trace at ``path``, and the GPU's idle
    time between its operations."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            add_prompts()
            llm.step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        gaps = find_gaps(device_ops(json.load(f)))
    idle_ms = (gaps.span_us - gaps.busy_us) / 1e3
    print(f"engine loop, {steps} steps: GPU idle {idle_ms / steps:.3f} ms a step ({path}); largest gaps:")
    for (before, after), (us, n) in sorted(gaps.idle_by_pair.items(), key=lambda item: -item[1][0])[:12]:
        print(f"  {us / steps:8.1f} us a step, {n:4d} gaps: {before} -> {after}")


def device_time(prof, reps: int) -> tuple[float, float, float]:
    """Per repetition of what ``prof`` recorded: ms the device was busy, kernels launched, and
    copies or fills."""
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    busy_ms = sum(e.self_device_time_total for e in events) / reps / 1e3
    copies = sum(e.count for e in events if e.key.startswith(("Memcpy", "Memset"))) / reps
    return busy_ms, sum(e.count for e in events) / reps - copies, copies


def replay_alone(graphs, batch: int, reps: int = 50) -> None:
    """The decode graph of ``batch`` rows replayed back to back (its inputs as the last step left
    them): its time against the sum of its kernels is how long the GPU waits between kernels
    inside a graph (launch gaps), apart from the host's share of a step."""
    rows = next(b for b in graphs.batch_sizes if b >= batch)
    graph = graphs.graphs[rows]
    wall_ms = replay_ms(graph, reps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    busy_ms, launches, copies = device_time(prof, 5)
    count = launches + copies
    idle_us = (wall_ms - busy_ms) * 1e3 / max(count, 1)
    print(
        f"decode graph ({rows} rows) replayed alone: {wall_ms:.3f} ms, its {count:.0f} kernels "
        f"{busy_ms:.3f} ms: {idle_us:.2f} us idle per kernel"
    )


if __name__ == "__main__":
    main()
