"""Host-side cost of the per-step bookkeeping, in microseconds (CPU only, no model).

    PYTHONPATH=. taskset -c 0 python benchmarks/bench_host.py

Times, each the median of several repeats:
- taking a free KV block, averaged over taking every block of an 8k / 64k-block cache;
- hashing one full 256-token block;
- admitting a 1,000-token prompt whose first 512 tokens are cached, and retrying a prompt
  that does not fit (a blocked head of the queue, retried every step);
- planning a decode step of 256 sequences (~1,024 tokens of context each, block size 256) and
  building its input tensors, plus the size of the pickled plan that TP workers receive;
- drawing the uniforms of 256 seeded rows.
"""

import pickle
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from nanovllm.config import Config
from nanovllm.demo_models import write_config
from nanovllm.execution.step_inputs import StepInputBuilder
from nanovllm.kernels.sample import seeded_uniforms_ref
from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling import BlockManager, Scheduler, Sequence
from nanovllm.scheduling.block_manager import block_hash

BLOCK = 256


def median_us(fn: Callable[[], object], repeats: int = 7, number: int = 1) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return statistics.median(times) * 1e6


def take_all_blocks(num_blocks: int) -> float:
    """Mean µs per take while every block of a fresh cache is taken in turn."""
    results = []
    for _ in range(3):
        bm = BlockManager(num_blocks, BLOCK)
        start = time.perf_counter()
        for _ in range(num_blocks):
            bm._take_free_block()
        results.append((time.perf_counter() - start) / num_blocks)
    return statistics.median(results) * 1e6


def admission() -> tuple[float, float]:
    """µs to admit a 1,000-token prompt with a 512-token cached prefix; µs for a retry of a
    prompt that does not fit."""
    prefix = list(range(512))
    bm = BlockManager(64, BLOCK)
    first = Sequence(0, prefix + [7] * 100, SamplingParams())
    bm.allocate(first)
    first.num_computed_tokens = len(first)
    bm.commit_computed(first)
    ids = iter(range(1, 10**6))

    def admit_and_free():
        seq = Sequence(next(ids), prefix + list(range(1000, 1488)), SamplingParams())
        bm.allocate(seq)
        bm.free(seq)

    blocked = Sequence(-1, prefix + list(range(5000, 5000 + 70 * BLOCK)), SamplingParams())
    return median_us(admit_and_free, number=200), median_us(lambda: bm.allocate(blocked), number=200)


def decode_step(builder: StepInputBuilder) -> tuple[float, float, float, int]:
    """µs to schedule (classify, reserve slots, plan) and to build the inputs of a 256-row
    decode step, as it is and padded for a CUDA graph of 256 rows; bytes of its pickle.
    Scheduling again before postprocessing is a no-op."""
    num_seqs, context = 256, 1024
    blocks = num_seqs * (context // BLOCK + 1)
    sched = Scheduler(BlockManager(blocks, BLOCK), num_seqs, 16384, 4096)
    for i in range(num_seqs):
        sched.add(
            Sequence(i, [(i * 7 + j) % 10000 for j in range(context)], SamplingParams(max_tokens=10**6))
        )
    while sched.waiting:  # admit and prefill everything (no model: pretend each step ran)
        step = sched.schedule()
        builder.build(step.batch)
        sched.update_from_output(step, [1] * len(step.seqs))
    batch = sched.schedule().batch
    builder.build(batch)
    return (
        median_us(sched.schedule, number=20),
        median_us(lambda: builder.build(batch), number=20),
        median_us(lambda: builder.build(batch, pad_to=num_seqs), number=20),
        len(pickle.dumps(batch)),
    )


def main() -> None:
    torch.set_num_threads(1)
    print(f"take a free block, 8k blocks:  {take_all_blocks(8192):8.3f} µs")
    print(f"take a free block, 64k blocks: {take_all_blocks(65536):8.3f} µs")
    tokens = list(range(BLOCK))
    hash_us = median_us(lambda: block_hash(tokens, 12345), number=2000)
    print(f"hash a {BLOCK}-token block:      {hash_us:8.3f} µs")
    admit, retry = admission()
    print(f"admit, 512 of 1,000 cached:    {admit:8.1f} µs")
    print(f"retry a prompt that won't fit: {retry:8.1f} µs")
    with tempfile.TemporaryDirectory() as path:
        write_config(path, num_hidden_layers=1)
        config = Config(path, device="cpu", max_num_seqs=256, kvcache_block_size=BLOCK, max_model_len=4096)
        plan, build, padded, size = decode_step(StepInputBuilder(config, torch.device("cpu")))
    print(f"schedule a 256-row decode step: {plan:7.1f} µs ({size:,} bytes pickled for TP workers)")
    print(f"build its input tensors:       {build:8.1f} µs ({padded:.1f} µs padded for a graph)")
    seeds, steps = torch.arange(256), torch.arange(256)
    seeded_us = median_us(lambda: seeded_uniforms_ref(seeds, steps), number=50)
    print(f"uniforms of 256 seeded rows:   {seeded_us:8.1f} µs")


if __name__ == "__main__":
    main()
