"""What the RL calls cost: weight sync, sleep and wake, a rollout loop (CUDA; runs small on CPU).

    PYTHONPATH=. python3 benchmarks/bench_rl.py [--shape qwen3-8b] [--rollout-shape qwen3-0.6b]

On a random-weight model of ``--shape``:
- ``load_weights`` of every weight, from tensors on the GPU and from pinned CPU tensors, in
  seconds and GB/s, beside the plain copy rate of the same bytes (device to device, host to
  device) for the floor;
- ``sleep(1)`` and ``wake_up()`` times, and the GPU memory the process holds while asleep
  beyond what it held before the engine started (``torch.cuda.memory_allocated`` and the
  driver's view, ``mem_get_info``);
then on ``--rollout-shape``, ``--iterations`` of (sync every weight, generate ``--batch``
requests of ``--max-tokens``): each iteration's time against a generate alone.
"""

import argparse
import statistics
import tempfile
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.demo_models import write_config


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(function) -> float:
    synchronize()
    start = time.perf_counter()
    function()
    synchronize()
    return time.perf_counter() - start


def hf_named_weights(path: str, dtype: torch.dtype, device: str) -> list[tuple[str, torch.Tensor]]:
    """Random weights under the Hugging Face names and shapes of the model at ``path``, as a
    trainer holds them (q/k/v and gate/up apart, a tied head once), on ``device``; pinned when on
    the CPU of a GPU machine."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    drawn_on = "cuda" if torch.cuda.is_available() else "cpu"
    pin = device == "cpu" and torch.cuda.is_available()
    weights = []
    for name, param in hf.named_parameters():
        values = torch.empty(param.shape, dtype=dtype, device=drawn_on).normal_(0, 0.02)
        held = torch.empty(param.shape, dtype=dtype, device=device, pin_memory=pin)
        weights.append((name, held.copy_(values)))
    return weights


def copy_rate(weights: list[tuple[str, torch.Tensor]], device: torch.device) -> float:
    """Seconds to copy the same tensors once into preallocated ones on ``device``."""
    targets = [torch.empty_like(t, device=device) for _, t in weights]
    return timed(lambda: [dst.copy_(src, non_blocking=True) for dst, (_, src) in zip(targets, weights)])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--rollout-shape", default="qwen3-0.6b")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--small", action="store_true", help="tiny shapes, for a dry run on the CPU")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    overrides = (
        dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=4096)
        if args.small
        else {}
    )
    # the engine leaves room for a second copy of the weights (the trainer's, in a colocated run)
    options = dict(
        load_format="dummy", enable_sleep_mode=True, max_model_len=2048, gpu_memory_utilization=0.45
    )
    if not cuda:
        options.update(device="cpu", dtype="float32")
    dtype = torch.bfloat16 if cuda else torch.float32  # the engine's (the shapes' bf16, or the CPU's)

    path = tempfile.mkdtemp(prefix="nanovllm-rl-")
    write_config(path, args.shape, **overrides)
    before_engine = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0] if cuda else 0
    llm = LLM(path, **options)
    device = torch.device("cuda" if cuda else "cpu")
    for where in ("cuda", "cpu") if cuda else ("cpu",):
        weights = hf_named_weights(path, dtype, where)
        gigabytes = sum(t.numel() * t.element_size() for _, t in weights) / 1e9
        seconds = timed(lambda weights=weights: llm.load_weights(weights))
        floor = copy_rate(weights, device)
        print(
            f"load_weights from {where}: {gigabytes:.2f} GB in {seconds:.2f} s "
            f"({gigabytes / seconds:.1f} GB/s); plain copy {floor:.2f} s ({gigabytes / floor:.1f} GB/s)"
        )
        del weights
    if cuda:
        torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated() if cuda else 0
    asleep_s = timed(lambda: llm.sleep(level=1))
    if cuda:
        used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0] - before_engine
        print(
            f"asleep: memory_allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB "
            f"(awake {held / 2**30:.2f}); device memory beyond the process's start {used / 2**30:.2f} GiB"
        )
    awake_s = timed(lambda: llm.wake_up())
    print(f"sleep(1) {asleep_s:.2f} s, wake_up() {awake_s:.2f} s")
    llm.exit()

    path = tempfile.mkdtemp(prefix="nanovllm-rl-")
    write_config(path, args.rollout_shape, **overrides)
    llm = LLM(path, **{**options, "enable_sleep_mode": False})
    weights = hf_named_weights(path, dtype, "cuda" if cuda else "cpu")
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(64)]} for i in range(args.batch)]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    alone = [timed(lambda: llm.generate(prompts, params, use_tqdm=False)) for _ in range(args.iterations)]
    synced = [
        timed(lambda: (llm.load_weights(weights), llm.generate(prompts, params, use_tqdm=False)))
        for _ in range(args.iterations)
    ]
    overhead = statistics.median(synced) - statistics.median(alone)
    print(
        f"rollout {args.batch} x {args.max_tokens} tokens: generate {statistics.median(alone):.3f} s, "
        f"sync + generate {statistics.median(synced):.3f} s: {overhead * 1e3:.0f} ms per iteration"
    )
    llm.exit()


if __name__ == "__main__":
    main()
