"""Can decode attention (memory-bound) and the GEMMs (compute-bound) share the GPU by SMs?

    PYTHONPATH=. python3 benchmarks/bench_sm_partition.py [--rows 1024] [--context 900] [--sms 32,48,64]

Qwen3-8B's layer shapes, ``--layers`` layers one after another, eager launches timed with CUDA
events. For each SM count N it runs decode attention over ``--rows`` rows in a CUDA green
context of N SMs, on a stream of its own, while the four projections of the same rows run on
the rest of the device (the primary context), and compares that with the two one after the
other on every SM. Two streams without a partition do not overlap (each kernel fills every
SM); a partition is the question here. Needs torch's green contexts (CUDA 12.8+).
"""

import argparse
from functools import partial

import torch
import torch.nn.functional as F

from nanovllm.kernels.decode_attention import paged_decode_attention

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, BLOCK = 32, 8, 128, 4096, 12288, 128


def layer_inputs(rows: int, context: int, layers: int):
    blocks_per_row = -(-context // BLOCK)
    num_blocks = rows * blocks_per_row
    caches = []
    for _ in range(layers):
        k = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        caches.append((k, torch.randn_like(k)))
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(rows, blocks_per_row)
    ctx = torch.full((rows,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    shapes = [
        (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
        (HEADS * HEAD_DIM, HIDDEN),
        (HIDDEN, 2 * INTER),
        (INTER, HIDDEN),
    ]
    weights = [
        [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for k, n in shapes]
        for _ in range(layers)
    ]
    xs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k, _ in shapes]
    return caches, tables, ctx, q, weights, xs  # fmt: skip


def attention(caches, tables, ctx, q) -> None:
    for k, v in caches:
        paged_decode_attention(q, k, v, tables, ctx, HEAD_DIM**-0.5)


def gemms(weights, xs) -> None:
    for layer in weights:
        for x, w in zip(xs, layer):
            F.linear(x, w)


def timed_ms(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def attention_in(green, caches, tables, ctx, q) -> None:
    green.set_context()  # work launched from this thread now runs on the green context's SMs
    attention(caches, tables, ctx, q)
    green.pop_context()  # (the stream current before waits for that work)


def side_by_side(green, caches, tables, ctx, q, weights, xs) -> None:
    """Attention in the green context from a side stream, GEMMs on the current stream."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        attention_in(green, caches, tables, ctx, q)
    gemms(weights, xs)
    main.wait_stream(side)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--context", type=int, default=900)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sms", default="32,48,64,80")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    from torch.cuda.green_contexts import GreenContext

    caches, tables, ctx, q, weights, xs = layer_inputs(args.rows, args.context, args.layers)
    kv_bytes = args.layers * args.rows * args.context * KV_HEADS * HEAD_DIM * 2 * 2
    attn = timed_ms(lambda: attention(caches, tables, ctx, q))
    gemm = timed_ms(lambda: gemms(weights, xs))
    total_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{args.rows} rows x {args.context} tokens, {args.layers} layers, {total_sms} SMs")
    print(f"all SMs: attention {attn:.2f} ms ({kv_bytes / attn / 1e6:.0f} GB/s), GEMMs {gemm:.2f} ms,")
    print(f"one after the other {attn + gemm:.2f} ms")
    for n in map(int, args.sms.split(",")):
        green = GreenContext.create(n, 0)
        alone = timed_ms(partial(attention_in, green, caches, tables, ctx, q))
        both = timed_ms(partial(side_by_side, green, caches, tables, ctx, q, weights, xs))
        print(
            f"attention on {n:3d} SMs: {alone:.2f} ms alone ({kv_bytes / alone / 1e6:.0f} GB/s); "
            f"beside the GEMMs {both:.2f} ms, {(attn + gemm) / both:.2f}x one after the other"
        )


if __name__ == "__main__":
    main()
