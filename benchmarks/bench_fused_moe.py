"""TFLOP/s of the fused MoE kernels against the per-expert torch loop (CUDA only).

Run from the project root: ``PYTHONPATH=. python3 benchmarks/bench_fused_moe.py``.
Shape of Qwen3-30B-A3B's MoE layers: hidden 2048, moe_intermediate 768, 128 experts, top-8, bf16.
FLOPs count the routed work, 6 * hidden * inter per (token, expert) pair; at few tokens the layer
is bound by the expert weights it reads, so their bandwidth (GB/s of distinct experts' weights) is
shown too. The fused kernels are timed as a CUDA-graph replay (as decode steps run them: GPU time,
no launch overhead); the torch loop syncs with the host, so it runs eagerly.
"""

import argparse

import torch
from triton.testing import do_bench

from nanovllm.kernels.fused_moe import fused_moe, fused_moe_ref

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
DTYPE = torch.bfloat16


def graph_replay(fn) -> callable:
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream, as capture requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench(tokens: int, rep_ms: int, weights: tuple[torch.Tensor, torch.Tensor]) -> None:
    w13, w2 = weights
    x = torch.randn(tokens, HIDDEN, dtype=DTYPE, device="cuda")
    logits = torch.randn(tokens, EXPERTS, device="cuda")
    topk_weights, topk_ids = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
    topk_weights /= topk_weights.sum(-1, keepdim=True)
    got = fused_moe(x, w13, w2, topk_weights, topk_ids)
    want = fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    err = (got.float() - want.float()).abs().max().item()
    flops = 6 * HIDDEN * INTER * tokens * TOP_K
    weight_bytes = len(topk_ids.unique()) * 3 * HIDDEN * INTER * w13.element_size()
    row = [f"{tokens:>6}"]
    fused = graph_replay(lambda: fused_moe(x, w13, w2, topk_weights, topk_ids))
    loop = lambda: fused_moe_ref(x, w13, w2, topk_weights, topk_ids)  # noqa: E731
    for fn in (fused, loop):
        ms = do_bench(fn, rep=rep_ms, return_mode="median")
        rate = f"{flops / ms / 1e9:>7.2f} TFLOP/s {weight_bytes / ms / 1e6:>7.0f} GB/s"
        row.append(f"{ms * 1e3:>9.1f} us {rate}")
    print(" | ".join(row) + f" | max |diff| {err:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512, 4096])
    parser.add_argument("--rep-ms", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=DTYPE, device="cuda") / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, dtype=DTYPE, device="cuda") / INTER**0.5
    print(f"{'tokens':>6} | {'fused_moe (Triton, graph)':^44} | {'per-expert torch loop':^44}")
    for tokens in args.tokens:
        bench(tokens, args.rep_ms, (w13, w2))


if __name__ == "__main__":
    main()
