"""The fused linear kernel against what it replaces (cuBLAS GEMM + RMSNorm / SwiGLU / residual
add kernels), at decode batch sizes of the bench shapes, as CUDA-graph replays.

Run from the project root: ``PYTHONPATH=. python3 benchmarks/bench_fused_linear.py [--shape qwen3-8b]``.
Each timing replays a graph of ``LAYERS`` calls, each with its own weights (no L2 reuse between
calls, as in a model's layers), and reports microseconds per call.
"""

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from nanovllm.kernels.fused_linear import fused_linear
from nanovllm.kernels.silu_and_mul import silu_and_mul
from nanovllm.layers.layernorm import rms_norm

SHAPES = {"qwen3-0.6b": (1024, 2048, 3072, 4096), "qwen3-8b": (4096, 4096, 12288, 6144)}
LAYERS = 8
DTYPE = torch.bfloat16


def graph_us(fn, weights: list[torch.Tensor], *args, **kwargs) -> float:
    """``fn(x, w, ...)`` for every ``w`` in one graph; microseconds per call."""
    for w in weights:  # compile outside the capture
        fn(args[0], w, *args[1:], **kwargs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(args[0], w, *args[1:], **kwargs)
    return do_bench(graph.replay, rep=100, return_mode="median") * 1e3 / LAYERS


def unfused_op(x, w, kind: str, norm_w, res, norm_fn):
    """What the decoder layer runs today: a cuBLAS GEMM beside separate kernels."""
    if kind == "norm":
        return F.linear(norm_fn(x, norm_w, 1e-6), w)
    if kind == "swiglu":
        return silu_and_mul(F.linear(norm_fn(x, norm_w, 1e-6), w))
    return res + F.linear(x, w)


def fused_kwargs(kind: str, norm_w, res) -> dict:
    return {"norm": {"norm_weight": norm_w}, "swiglu": {"norm_weight": norm_w, "swiglu": True}}.get(
        kind, {"residual": res}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,16,64,128,256,384,512")
    args = parser.parse_args()
    hidden, attn, inter, qkv = SHAPES[args.shape]
    norm_fn = torch.compile(rms_norm, dynamic=True)  # as the engine compiles its norms
    ops = {  # name: (K, N, what is fused)
        "qkv (norm)": (hidden, qkv, "norm"),
        "gate_up (norm, swiglu)": (hidden, 2 * inter, "swiglu"),
        "o (residual)": (attn, hidden, "residual"),
        "down (residual)": (inter, hidden, "residual"),
    }
    print(f"{args.shape}, {LAYERS} calls a graph, bf16; microseconds a call")
    print(f"{'op':24} {'rows':>5} {'unfused':>9} {'fused':>9} {'speed-up':>8} {'max diff':>9}")
    for name, (k, n, kind) in ops.items():
        weights = [torch.randn(n, k, dtype=DTYPE, device="cuda") / k**0.5 for _ in range(LAYERS)]
        norm_w = torch.rand(k, dtype=DTYPE, device="cuda") + 0.5
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, dtype=DTYPE, device="cuda")
            res = torch.randn(rows, n // 2 if kind == "swiglu" else n, dtype=DTYPE, device="cuda")
            kwargs = fused_kwargs(kind, norm_w, res)
            t_unfused = graph_us(unfused_op, weights, x, kind, norm_w, res, norm_fn)
            t_fused = graph_us(fused_linear, weights, x, **kwargs)
            want = unfused_op(x, weights[0], kind, norm_w, res, rms_norm)
            diff = (fused_linear(x, weights[0], **kwargs).float() - want.float()).abs().max().item()
            print(
                f"{name:24} {rows:>5} {t_unfused:>9.1f} {t_fused:>9.1f} "
                f"{t_unfused / t_fused:>7.2f}x {diff:>9.3g}"
            )
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
