"""The 8B bench workload through the real scheduler, priced by an H200 cost model (no GPU).

    PYTHONPATH=. python3 benchmarks/simulate_schedule.py [--configs 256:768,128:1024]

Each config is ``kvcache_block_size:max_num_seqs``. The Scheduler and BlockManager plan every
step as the engine does (steps planned one at a time, every sampled token known), so the
step count, the rows of each step and the preemptions are exact for that planning. Each step
is then priced on one H200 for Qwen3-8B:

- GEMMs: ``max(weight read, rows x per-row cost)``, the per-row cost of qkv + o + gate_up +
  down interpolated from cuBLAS times measured at 16 to 1,024 rows (graph replays, 8 layers'
  weights) and from a 16,384-token prefill at ~790 TFLOP/s; plus lm_head for decode rows;
- decode attention: every decode row's K/V bytes at 4.3 TB/s (the kernel runs at copy speed);
- 5% for the norms, rotary, KV stores and sampling.

It estimates where a scheduling choice moves the bench, before device time is spent on it;
how its estimates compared with ``bench.py`` and ``trace_generate.py`` is in
``benchmarks/MEASUREMENTS.md``.
"""

import argparse

import numpy as np

from bench import workload
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.scheduling.scheduler import Scheduler
from nanovllm.scheduling.sequence import Sequence
from nanovllm.scheduling.step import StepOutput

LAYERS = 36
KV_BYTES_PER_TOKEN = LAYERS * 8 * 128 * 2 * 2  # K and V, 8 KV heads of 128 dims, bf16
GEMM_ROWS = np.array([16, 128, 256, 320, 384, 448, 512, 1024, 16384])
GEMM_US_PER_ROW_LAYER = np.array([7.05, 0.978, 0.713, 0.670, 0.636, 0.628, 0.615, 0.582, 0.489])
LM_HEAD_US_PER_ROW = 2.0
WEIGHT_READ_MS = 3.8  # 16.4 GB of weights at 4.3 TB/s
KV_BYTES_PER_S = 4.3e12
OTHER_KERNELS = 1.05


def step_ms(decode_rows: int, prompt_tokens: int, decode_context: int) -> float:
    rows = decode_rows + prompt_tokens
    per_row = np.interp(rows, GEMM_ROWS, GEMM_US_PER_ROW_LAYER) * LAYERS / 1e3
    gemm = max(WEIGHT_READ_MS, rows * per_row) + decode_rows * LM_HEAD_US_PER_ROW / 1e3
    attention = decode_context * KV_BYTES_PER_TOKEN / KV_BYTES_PER_S * 1e3
    return (gemm + attention) * OTHER_KERNELS


def simulate(args, block_size: int, max_num_seqs: int) -> dict[str, float]:
    prompts, max_tokens = workload(args)
    blocks = BlockManager(args.cache_tokens // block_size, block_size, True)
    scheduler = Scheduler(blocks, max_num_seqs, args.max_num_batched_tokens, 4096, mixed_steps=True)
    outputs = OutputProcessor(scheduler, (), 4096)
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        scheduler.add(Sequence(i, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True)))
    seconds = {"decode": 0.0, "mixed": 0.0}
    steps = {"decode": 0, "mixed": 0}
    tokens = {"decode": 0, "prompt": 0}
    while not scheduler.is_finished():
        step = scheduler.schedule()
        batch = step.batch
        d = step.num_decodes
        prompt_tokens = sum(batch.num_tokens[d:])
        context = sum(start + 1 for start in batch.start_positions[:d])
        kind = "mixed" if prompt_tokens else "decode"
        seconds[kind] += step_ms(d, prompt_tokens, context) / 1e3
        steps[kind] += 1
        tokens["decode"] += d
        tokens["prompt"] += prompt_tokens
        outputs.process(step, StepOutput([1] * len(step.seqs)))
    return {
        "total": sum(seconds.values()),
        "preemptions": scheduler.num_preemptions,
        "decode tokens": tokens["decode"],
        "prompt tokens": tokens["prompt"],
        **{f"{k} s": v for k, v in seconds.items()},
        **{f"{k} steps": v for k, v in steps.items()},
    }


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--configs", default="256:512,256:768,256:1024,128:1024,64:1024")
    parser.add_argument("--cache-tokens", type=int, default=3077 * 256, help="KV cache size (8B at 0.9)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--num-seqs", type=int, default=1024)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    args = parser.parse_args()
    print("block  seqs  estimate (s)  preemptions  decode steps (s)  mixed steps (s)")
    for config in args.configs.split(","):
        block_size, max_num_seqs = map(int, config.split(":"))
        r = simulate(args, block_size, max_num_seqs)
        print(
            f"{block_size:5d} {max_num_seqs:5d} {r['total']:13.2f} {r['preemptions']:12d} "
            f"{r['decode steps']:6d} ({r['decode s']:5.1f}) {r['mixed steps']:8d} ({r['mixed s']:5.1f})"
        )


if __name__ == "__main__":
    main()
