"""The ops that round a projection's input to FP8 (``quantization="fp8"``) against their
model-dtype versions, at a step's row counts: which kernel, which tiles.

    PYTHONPATH=. python3 benchmarks/bench_fp8_activations.py [--shape qwen3-8b] [--rows 1,256,16384]

SwiGLU before down (gate/up interleaved, ``[rows, 2 * intermediate]`` bf16 in):

- ``bf16``: the model-dtype SwiGLU kernel (``silu_and_mul``), the baseline;
- ``separate``: that kernel, then the per-token quantizer (``quantize_per_token_group``);
- ``compiled``: ``torch.compile(silu_and_mul_fp8_ref, dynamic=True)``, as the engine first ran it;
- ``fp8 B/W/C[s]``: ``silu_and_mul_fp8`` with ``block=B`` columns per step (the whole row in
  registers where ``B`` covers it), ``num_warps=W``, ``chunks=C`` programs per row, ``s``: gate and
  up as two strided loads (``paired=False``); ``fp8`` its default.

RMSNorm after the residual add (``[rows, hidden]`` bf16 in): ``bf16`` the compiled model-dtype
norm (as the engine runs it), ``compiled`` the compiled FP8 reference, ``fp8`` the Triton kernel.

Each is timed as a CUDA-graph replay over ``--copies`` distinct inputs (so that no call finds its
input in L2, as in a step) and checked against the reference first. Prints microseconds per call
and the share of the copy rate each reaches on the bytes it must move (``--copy-gbps``).
"""

import argparse
from functools import partial

import torch

from benchmarks.cuda_graphs import graph_us
from nanovllm.demo_models import SHAPES
from nanovllm.kernels.fp8 import quantize_per_token_group
from nanovllm.kernels.rms_norm import add_rms_norm_ref, rms_norm_fp8, rms_norm_fp8_ref
from nanovllm.kernels.silu_and_mul import silu_and_mul, silu_and_mul_fp8, silu_and_mul_fp8_ref

# (block, num_warps, chunks, paired) of silu_and_mul_fp8
FP8_TILES = [
    (2048, 8, 1, True), (2048, 8, 1, False), (1024, 4, 1, False), (4096, 8, 1, False),
    (16384, 32, 1, False), (1024, 4, 4, True), (1024, 4, 12, True), (1024, 4, 12, False),
    (2048, 8, 6, False), (512, 4, 24, False), (4096, 16, 3, False),
]  # fmt: skip


def separate(y: torch.Tensor):
    return quantize_per_token_group(silu_and_mul(y), group=y.shape[1] // 2)


def checked(fn, args, want) -> bool:
    """Whether ``fn(*args)``'s FP8 values and scales match ``want``'s (up to last-bit moves)."""
    try:
        got = fn(*args)
    except Exception as exc:  # a tile that does not compile here
        print(f"  skipped {getattr(fn, '__name__', fn)}: {type(exc).__name__}")
        return False
    q, s = got[0].float(), got[1]
    return bool(torch.allclose(s, want[1], rtol=1e-2) and (q == want[0].float()).float().mean() > 0.98)


def row(label: str, us: float, nbytes: int, copy_gbps: float) -> None:
    share = nbytes / (us * 1e-6) / (copy_gbps * 1e9)
    print(f"  {label:>14} {us:10.1f} us  {share:6.0%} of the copy rate")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,16,64,256,1024,4096,16384")
    parser.add_argument("--copies", type=int, default=6, help="distinct inputs per graph")
    parser.add_argument("--rep-ms", type=int, default=60)
    parser.add_argument("--copy-gbps", type=float, default=4300.0, help="the GPU's copy rate, GB/s")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    compiled_swiglu = torch.compile(silu_and_mul_fp8_ref, dynamic=True)
    compiled_norm = torch.compile(rms_norm_fp8_ref, dynamic=True)
    compiled_add_norm = torch.compile(add_rms_norm_ref, dynamic=True)
    gen = torch.Generator("cuda").manual_seed(0)

    def inputs(rows: int, cols: int) -> list[torch.Tensor]:
        return [torch.randn(rows, cols, device="cuda", generator=gen).bfloat16() for _ in range(args.copies)]

    print(f"{torch.cuda.get_device_name()}, {args.shape}: hidden {hidden}, intermediate {inter}")
    for rows in [int(r) for r in args.rows.split(",")]:
        ys = [
            torch.randn(rows, 2 * inter, device="cuda", generator=gen).bfloat16() for _ in range(args.copies)
        ]
        want = silu_and_mul_fp8_ref(ys[0])
        print(f"rows {rows}, SwiGLU ({2 * inter} -> {inter}):")
        row(
            "bf16",
            graph_us([partial(silu_and_mul, y) for y in ys], args.rep_ms),
            rows * inter * 6,
            args.copy_gbps,
        )
        fp8_bytes = rows * (inter * 5 + 4)
        cases = [("separate", separate, {}), ("compiled", compiled_swiglu, {}), ("fp8", silu_and_mul_fp8, {})]
        for b, w, c, p in FP8_TILES:
            tiles = dict(block=b, num_warps=w, chunks=c, paired=p)
            cases.append((f"fp8 {b}/{w}/{c}{'' if p else 's'}", silu_and_mul_fp8, tiles))
        for label, fn, tiles in cases:
            fn = partial(fn, **tiles)
            if checked(fn, (ys[0],), want):
                row(label, graph_us([partial(fn, y) for y in ys], args.rep_ms), fp8_bytes, args.copy_gbps)
        xs, rs = inputs(rows, hidden), inputs(rows, hidden)
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).bfloat16()
        want = rms_norm_fp8_ref(xs[0], weight, 1e-6, rs[0])
        print(f"rows {rows}, add + RMSNorm ({hidden}):")
        pairs = list(zip(xs, rs))
        bf16 = [partial(compiled_add_norm, x, r, weight, 1e-6) for x, r in pairs]
        row("bf16", graph_us(bf16, args.rep_ms), rows * hidden * 8, args.copy_gbps)
        for label, fn in (("compiled", compiled_norm), ("fp8", rms_norm_fp8)):
            if checked(fn, (xs[0], weight, 1e-6, rs[0]), want):
                calls = [partial(fn, x, weight, 1e-6, r) for x, r in pairs]
                row(label, graph_us(calls, args.rep_ms), rows * (hidden * 7 + 4), args.copy_gbps)


if __name__ == "__main__":
    main()
