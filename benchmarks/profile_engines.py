"""Where a decode step's GPU time goes, kernel by kernel, in nanovllm or vLLM, through the public
``generate`` alone, so that both engines are profiled the same way.

    PYTHONPATH=. python3 benchmarks/profile_engines.py --engine nanovllm|vllm [--shape qwen3-30b-a3b]
        [--quantization fp8] [--batch 256 [64 ...]] [--context 600] [--steps 50]

For each ``--batch`` (one engine serves them all), two profiled generates of that many fresh
random prompts of ``--context`` tokens: one token each (the prompts' work), then ``--steps`` + 1
tokens each (the same prompt work and ``--steps`` decode steps of that many rows). Each
kernel's GPU time in the second less the first, over ``--steps``, is its share of one decode
step; the wall times' difference over ``--steps`` is the step's wall time. (Both engines give a
request its first token with its prompt and start decoding it while later prompts are still
read, so a few of the decode rows ride in the prompts' steps: take ``--steps`` well above the
prompts' steps, ``batch * context / 16384``.) vLLM runs its engine in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the profiler sees its kernels. Random weights for
both (``load_format="dummy"``), vLLM's refilled with nanovllm's recipe unless ``--vllm-weights``
(:func:`benchmarks.engines.refill_like_nanovllm`). On CPU (a dry run with nanovllm) the table
lists operators instead.
"""

import argparse
import os
import random
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engines import refill_like_nanovllm
from nanovllm.demo_models import SHAPES, write_config


def make_engine(args, path: str):
    """``generate(prompts, max_tokens) -> completions' token ids`` of the chosen engine, warmed up."""
    max_model_len = args.context + args.steps + 64
    common = dict(load_format="dummy", max_model_len=max_model_len, quantization=args.quantization)
    if args.engine == "vllm":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(path, skip_tokenizer_init=True, max_num_seqs=max(256, *args.batch), **common)
        if not args.vllm_weights:
            llm.apply_model(refill_like_nanovllm)

        def generate(prompts, max_tokens):
            params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens, detokenize=False)
            outputs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
            )
            return [list(o.outputs[0].token_ids) for o in outputs]

    else:
        from nanovllm import LLM, SamplingParams

        llm = LLM(path, max_num_seqs=max(256, *args.batch), **common)

        def generate(prompts, max_tokens):
            params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    generate([[1, 2, 3, 4]] * 8, 8)
    return generate


def profiled(generate, prompts, max_tokens: int) -> tuple[float, dict[str, tuple[float, int]], list]:
    """Wall seconds of one generate, each kernel's (or, on CPU, operator's) total µs and count,
    and the completions' token ids."""
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        completions = generate(prompts, max_tokens)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kind = "CUDA" if cuda else "CPU"
    return (
        wall,
        {
            e.key: (e.self_device_time_total if cuda else e.self_cpu_time_total, e.count)
            for e in prof.key_averages()
            if e.device_type.name == kind
        },
        completions,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=("nanovllm", "vllm"), default="nanovllm")
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--quantization", choices=("fp8",), default=None, help="FP8 weights")
    parser.add_argument("--batch", type=int, nargs="+", default=[256], help="decode rows, one table each")
    parser.add_argument("--context", type=int, default=600, help="prompt tokens of each request")
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed")
    parser.add_argument("--rows", type=int, default=25, help="kernels listed")
    parser.add_argument(
        "--vllm-weights", action="store_true", help="keep vLLM's own random weights (not nanovllm's recipe)"
    )
    args = parser.parse_args()
    path = tempfile.mkdtemp(prefix="profile-engines-")
    write_config(path, args.shape)
    generate = make_engine(args, path)
    rng = random.Random(0)
    for batch in args.batch:
        prompts = [
            [[rng.randrange(10000) for _ in range(args.context)] for _ in range(batch)] for _ in range(2)
        ]
        prompt_wall, prompt_kernels, _ = profiled(generate, prompts[0], 1)  # random ids: no prefix hits
        wall, kernels, completions = profiled(generate, prompts[1], args.steps + 1)
        per_step = {}
        for name, (us, n) in kernels.items():
            prompt_us, prompt_n = prompt_kernels.get(name, (0.0, 0))
            per_step[name] = ((us - prompt_us) / args.steps, (n - prompt_n) / args.steps)
        busy_ms = sum(us for us, _ in per_step.values()) / 1e3
        step_ms = (wall - prompt_wall) / args.steps * 1e3
        quantized = f", {args.quantization} weights" if args.quantization else ""
        print(
            f"{args.engine}, {args.shape}{quantized}: {batch} rows, context ~{args.context}: "
            f"{step_ms:.3f} ms a decode step (wall), {busy_ms:.3f} ms busy "
            f"(the prompt-only generate {prompt_wall:.2f} s)"
        )
        # the decode rows' inputs: with random weights, how alike the sampled tokens are sets how
        # many experts a step's rows route to
        distinct = [len({c[i] for c in completions}) for i in range(1, args.steps + 1)]
        print(f"distinct sampled tokens a step: mean {sum(distinct) / len(distinct):.1f} of {batch}")
        print(f"{'us a step':>10} {'launches':>9}  kernel")
        for name, (us, n) in sorted(per_step.items(), key=lambda item: -item[1][0])[: args.rows]:
            print(f"{us:10.1f} {n:9.1f}  {name[:110]}")
        print(flush=True)
    os._exit(0)  # vLLM's shutdown can hang; everything is printed


if __name__ == "__main__":
    main()
