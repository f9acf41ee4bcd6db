"""FP8 linear layers against bf16 at a step's row counts: which kernel to run for each layout.

    PYTHONPATH=. python3 benchmarks/bench_fp8.py [--shape qwen3-8b] [--rows 1,16,64,256,1024,4096]

For each projection of the shape (qkv, o, gate_up, down), timed as a CUDA-graph replay over
``--layers`` layers' weights (so that no layer finds its weight in L2, as in a step):

- ``bf16``: ``F.linear`` (cuBLAS), the baseline;
- ``rowwise``: per-token activation quantization (``quantize_per_token_group`` over the whole
  row) then ``torch._scaled_mm`` with row-wise scales and ``use_fast_accum=True`` (sums kept in
  the tensor cores' accumulator across K, as the Triton GEMM and vLLM's CUTLASS FP8 kernels keep
  them), as ``quantization="fp8"`` runs it from 129 rows; ``rowwise mm`` the product alone;
  ``mm exact acc`` the product with cuBLAS's periodic promotion to a full fp32 sum;
- ``block``: per-token-and-128 quantization then the Triton block-scaled GEMM
  (``fp8_gemm``), as an FP8 checkpoint's layers would run; ``block mm`` the GEMM alone;
- ``block layer``: the engine's block-scaled layer (``fp8_block_linear`` with the scales per block:
  the quantizer, then the Triton GEMM below ``CUBLAS_BLOCK_MIN_ROWS`` rows and from there
  ``torch._scaled_mm``'s 1x128 / 128x128 block-scaled product, rows padded to a multiple of 4).

- ``rowwise triton``: the per-channel product through the Triton GEMM (``fp8_gemm`` with its
  default tiles), as the engine runs per-channel layers below 129 rows; ``--sweep`` also tries
  ``SMALL_M_TILES`` (rows <= 32) or ``MID_M_TILES`` (33-256 rows) and prints the best tile per
  projection, to tune ``fp8_gemm_config`` for decode-sized batches against cuBLAS.

Every kernel's output is checked against the plain-torch reference before it is timed. Prints
microseconds per projection, the four together, and each column's speed-up over bf16.
"""

import argparse
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.bench_gemm import projections
from benchmarks.cuda_graphs import graph_us
from nanovllm.demo_models import SHAPES
from nanovllm.kernels.fp8 import (
    GROUP,
    quantize_per_token_group,
    quantize_weight_blockwise_ref,
    quantize_weight_per_channel_ref,
)
from nanovllm.kernels.fp8_gemm import (
    fp8_block_gemm_ref,
    fp8_channel_gemm_ref,
    fp8_gemm,
)
from nanovllm.layers.fp8 import fp8_block_linear


def rowwise(x, w, w_scale, mm_only=False, x_q=None, fast=True):
    if mm_only:
        q, s = x_q
    else:
        q, s = quantize_per_token_group(x, group=x.shape[1])
    scale_b = w_scale.view(1, -1)
    return torch._scaled_mm(q, w.T, scale_a=s, scale_b=scale_b, out_dtype=torch.bfloat16, use_fast_accum=fast)


def block(x, w, w_scale_inv, mm_only=False, x_q=None):
    q, s = x_q if mm_only else quantize_per_token_group(x, group=GROUP)
    return fp8_gemm(q, s, w, w_scale_inv, torch.bfloat16)


# fp8_gemm tiles tried by --sweep: up to 32 rows, and 33 to 256 (cuBLAS's range in the engine)
SMALL_M_TILES = [
    dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, num_warps=warps, num_stages=stages, SPLIT_K=split)
    for bn, bk, warps, stages, split in [
        (32, 256, 4, 4, 1), (64, 256, 4, 3, 1), (32, 128, 4, 5, 1), (32, 512, 4, 3, 1),
        (64, 512, 4, 3, 1), (16, 256, 4, 4, 2), (32, 256, 4, 4, 2), (64, 256, 4, 3, 2),
        (32, 512, 4, 3, 2), (128, 256, 8, 3, 2), (32, 256, 4, 4, 4), (64, 256, 4, 3, 4),
    ]
]  # fmt: skip
MID_M_TILES = [
    dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages, SPLIT_K=split)
    for bm, bn, bk, warps, stages, split in [
        (64, 64, 256, 4, 3, 1), (64, 64, 128, 4, 4, 1), (64, 64, 256, 4, 3, 2), (64, 128, 256, 4, 3, 2),
        (64, 64, 256, 4, 3, 4), (32, 64, 256, 4, 3, 2), (32, 128, 256, 4, 3, 2), (64, 128, 128, 4, 3, 1),
        (128, 64, 128, 4, 4, 1), (128, 64, 256, 4, 3, 2), (128, 128, 128, 8, 3, 1),
        (128, 128, 128, 8, 3, 2), (64, 256, 128, 8, 3, 1), (128, 256, 128, 8, 3, 1),
    ]
]  # fmt: skip


def sweep_tiles(rows: int) -> list[dict]:
    return SMALL_M_TILES if rows <= 32 else MID_M_TILES if rows <= 256 else []


def rowwise_triton(x, w, w_scale, x_q, config=None):
    q, s = x_q
    return fp8_gemm(q, s, w, w_scale, torch.bfloat16, config)


def best_tile(tiles, layers, rep_ms: int, expected: torch.Tensor) -> tuple[float, dict | None]:
    """The fastest of ``tiles`` for ``rowwise_triton`` over ``layers`` (each checked first)."""
    best = (float("inf"), None)
    for tile in tiles:
        fns = [partial(rowwise_triton, x, *c, q, tile) for x, (_, c, _), q, _ in layers]
        try:
            check("rowwise triton", fns[0](), expected)
        except (RuntimeError, AssertionError) as e:  # a tile that does not fit here
            print(f"  tile {tile}: {str(e).splitlines()[0][:120]}")
            continue
        best = min(best, (graph_us(fns, rep_ms), tile), key=lambda t: t[0])
    return best


def check(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    err = (got.float() - expected.float()).abs().max().item() / expected.float().abs().max().item()
    if err > 2e-2:
        raise AssertionError(f"{name} off by {err:.3g} (relative)")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,16,64,256,1024,4096,16384")
    parser.add_argument("--layers", type=int, default=6, help="layers' weights per graph")
    parser.add_argument("--rep-ms", type=int, default=60)
    parser.add_argument("--sweep", action="store_true", help="try fp8_gemm tiles at <= 256 rows")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    dims = projections(args.shape)
    weights = {}
    for name, (k, n) in dims.items():
        per_layer = []
        for _ in range(args.layers):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            per_layer.append((w, quantize_weight_per_channel_ref(w), quantize_weight_blockwise_ref(w)))
        weights[name] = per_layer
    columns = [
        "bf16", "rowwise", "rowwise mm", "mm exact acc", "rowwise triton", "block", "block mm", "block layer"
    ]  # fmt: skip
    print(f"{torch.cuda.get_device_name()}, {args.shape}, {args.layers} layers' weights per graph, us")
    print(f"{'rows':>6} {'proj':>8} " + " ".join(f"{c:>13}" for c in columns))
    for rows in map(int, args.rows.split(",")):
        totals, best_total = dict.fromkeys(columns, 0.0), 0.0
        for name, (k, _) in dims.items():
            xs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
            per_row = [quantize_per_token_group(x, group=k) for x in xs]
            per_group = [quantize_per_token_group(x, group=GROUP) for x in xs]
            (w, (wc, sc), (wb, sb)), x = weights[name][0], xs[0]
            check("rowwise", rowwise(x, wc, sc), fp8_channel_gemm_ref(*per_row[0], wc, sc, torch.bfloat16))
            check("block", block(x, wb, sb), fp8_block_gemm_ref(*per_group[0], wb, sb, torch.bfloat16))
            layers = list(zip(xs, weights[name], per_row, per_group))
            calls = {
                "bf16": [partial(F.linear, x, w) for x, (w, _, _), _, _ in layers],
                "rowwise": [partial(rowwise, x, *c) for x, (_, c, _), _, _ in layers],
                "rowwise mm": [partial(rowwise, x, *c, True, q) for x, (_, c, _), q, _ in layers],
                "mm exact acc": [partial(rowwise, x, *c, True, q, False) for x, (_, c, _), q, _ in layers],
                "rowwise triton": [partial(rowwise_triton, x, *c, q) for x, (_, c, _), q, _ in layers],
                "block": [partial(block, x, *b) for x, (_, _, b), _, _ in layers],
                "block mm": [partial(block, x, *b, True, g) for x, (_, _, b), _, g in layers],
                "block layer": [partial(fp8_block_linear, x, *b, None) for x, (_, _, b), _, _ in layers],
            }
            times = {}
            for column, fns in calls.items():
                try:
                    if column == "block layer":
                        check(column, fns[0](), fp8_block_gemm_ref(*per_group[0], wb, sb, torch.bfloat16))
                    if column in ("rowwise triton", "mm exact acc"):
                        check(column, fns[0](), fp8_channel_gemm_ref(*per_row[0], wc, sc, torch.bfloat16))
                    times[column] = graph_us(fns, args.rep_ms)
                except (RuntimeError, AssertionError, NotImplementedError) as e:
                    times[column] = float("nan")
                    if rows == 1 and name == "qkv":
                        print(f"  {column}: {str(e).splitlines()[0][:150]}")
                totals[column] += times[column]
            print(f"{rows:>6} {name:>8} " + " ".join(f"{times[c]:>13.1f}" for c in columns))
            if args.sweep and sweep_tiles(rows):
                expected = fp8_channel_gemm_ref(*per_row[0], wc, sc, torch.bfloat16)
                us, tile = best_tile(sweep_tiles(rows), layers, args.rep_ms, expected)
                best_total += us
                print(f"{'':>6} {'':>8} best triton tile {us:.1f} us: {tile}")
        print(f"{rows:>6} {'all':>8} " + " ".join(f"{totals[c]:>13.1f}" for c in columns))
        if best_total:
            mm = totals["rowwise mm"]
            print(f"{rows:>6} {'all':>8} best triton tiles {best_total:.1f} us, rowwise mm {mm:.1f} us")
        speedups = " ".join(f"{totals['bf16'] / totals[c]:>12.2f}x" for c in columns)
        print(f"{rows:>6} {'speedup':>8} " + speedups)


if __name__ == "__main__":
    main()
