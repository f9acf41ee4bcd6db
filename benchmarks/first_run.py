"""What the first run of fresh prompts does that the second does not: compiles, allocations, slow steps.

    PYTHONPATH=. python3 benchmarks/first_run.py [--shape qwen3-0.6b] [--num-seqs 256]
                                                 [--max-input-len 1024] [--max-output-len 1024]

One engine on random weights of ``--shape``, bench.py's warm-up generate (itself reported: the
first thing after ``LLM()`` returns), then bench.py's workload
twice: run 1 with the workload's prompts, run 2 with fresh ids of the same lengths (as
``--fresh-prompts`` draws them), so that neither finds the other's prompts in the prefix cache.
For each run it prints the wall time and what happened during it that a warm engine should not
do: Triton kernel variants compiled (by kernel, with their specialization keys), torch.compile
graphs compiled, and growth of the CUDA memory the caching allocator reserves; then run 1's
slowest steps against the median of run 2's steps of the same shape (decode rows, prompt tokens
in buckets of 256): a compile or an allocation in a step shows as a step many times its median.
On CPU it runs too (``--num-seqs 4 --max-input-len 32 --max-output-len 8``: a dry run; nothing
compiles there).
"""

import argparse
import statistics
import tempfile
import time
from collections import defaultdict

import torch

from bench import fresh_prompts, workload
from nanovllm import LLM, SamplingParams
from nanovllm.demo_models import SHAPES, write_config
from nanovllm.kernels.compiled import compiled_variants, dynamo_graphs, triton_kernels


def snapshot(kernels: dict[str, object]) -> dict:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    return {
        "variants": compiled_variants(kernels),
        "graphs": dynamo_graphs(),
        "reserved": torch.cuda.memory_reserved() if cuda else 0,
        "segments": torch.cuda.memory_stats().get("segment.all.current", 0) if cuda else 0,
    }


def step_shape(prefill: int, decode: int) -> tuple[int, int]:
    return (-(-prefill // 256) * 256, decode)


def timed_run(llm: LLM, prompts, params) -> tuple[float, list[tuple[tuple[int, int], float]]]:
    """Wall time of ``generate``, and each step's shape and seconds (``LLM.step`` timed)."""
    steps = []
    step = llm.step

    def timed_step():
        start = time.perf_counter()
        result = step()
        steps.append(
            (step_shape(result.num_prefill_tokens, result.num_decode_tokens), time.perf_counter() - start)
        )
        return result

    llm.step = timed_step
    try:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, steps
    finally:
        del llm.step


def report(what: str, seconds: float, before: dict, after: dict) -> None:
    new = {k: after["variants"][k] - before["variants"][k] for k in after["variants"]}
    new = {k: v for k, v in new.items() if v}
    grown = (after["reserved"] - before["reserved"]) / 2**20
    print(
        f"{what}: {seconds:.2f} s; Triton variants compiled: {sum(map(len, new.values()))}; "
        f"torch.compile graphs: {after['graphs'] - before['graphs']}; reserved memory "
        f"{grown:+.0f} MiB, allocator segments {after['segments'] - before['segments']:+d}"
    )
    for name, keys in sorted(new.items()):
        print(f"  {name}: {len(keys)} new: " + "; ".join(sorted(k[:100] for k in keys)[:3]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--quantization", default=None, help='as LLM(quantization=...): "fp8"')
    parser.add_argument("--slowest", type=int, default=12, help="run 1's slowest steps to list")
    args = parser.parse_args()
    path = tempfile.mkdtemp(prefix="nanovllm-first-run-")
    write_config(path, args.shape)
    options = dict(load_format="dummy", max_model_len=4096, quantization=args.quantization)
    if not torch.cuda.is_available():
        options.update(device="cpu", dtype="float32", max_model_len=256)
    llm = LLM(path, **options)
    prompts, max_tokens = workload(args)
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, detokenize=False) for n in max_tokens
    ]
    kernels = triton_kernels()
    before = snapshot(kernels)
    start = time.perf_counter()
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16), use_tqdm=False)  # bench.py's warm-up
    report("the warm-up generate (right after LLM())", time.perf_counter() - start, before, snapshot(kernels))
    runs = []
    for run in (1, 2):
        before = snapshot(kernels)
        seconds, steps = timed_run(llm, fresh_prompts(prompts, run - 1), params)
        report(f"run {run}", seconds, before, snapshot(kernels))
        runs.append(steps)
    medians = defaultdict(list)
    for shape, seconds in runs[1]:
        medians[shape].append(seconds)
    medians = {shape: statistics.median(times) for shape, times in medians.items()}
    print("run 1's slowest steps against run 2's median for the shape (prompt tokens up to, decode rows):")
    ranked = sorted(
        (
            (seconds / medians[shape], seconds, shape, i)
            for i, (shape, seconds) in enumerate(runs[0])
            if shape in medians
        ),
        reverse=True,
    )
    for ratio, seconds, shape, i in ranked[: args.slowest]:
        print(
            f"  step {i}: {shape}: {seconds * 1e3:.1f} ms, {ratio:.1f}x run 2's {medians[shape] * 1e3:.1f} ms"
        )
    extra = sum(max(0.0, s - medians[shape]) for shape, s in runs[0] if shape in medians)
    print(
        f"run 1's steps above run 2's medians: {extra:.2f} s in all; shapes run 2 never had: "
        f"{sum(1 for shape, _ in runs[0] if shape not in medians)} steps"
    )
    llm.exit()


if __name__ == "__main__":
    main()
