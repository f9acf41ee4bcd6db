"""The decoder's four projections at a step's row counts: cuBLAS, cuBLASLt and a plain Triton GEMM.

    PYTHONPATH=. python3 benchmarks/bench_gemm.py [--shape qwen3-8b] [--rows 256,1024] [--triton]
                                                   [--fused-tiles] [--splitk] [--small-batch]

Each case is ``F.linear(x, w)`` (``w``: ``[out, in]``, as the checkpoint stores it) for qkv,
o, gate_up and down, timed as a CUDA-graph replay over ``--layers`` layers' weights, so no
layer finds its weights in L2, as in a decode step. Prints microseconds and TFLOP/s per
projection, and the four together per row of a layer.

``--triton`` also times ``gemm_probes.py``'s plain Triton GEMM over its ``TILES``, ``--splitk`` its
split-K GEMMs (``SPLITK_TILES`` to 16 rows, ``MID_SPLITK_TILES`` above; "gemv", to 16 rows, the
same in one launch) and "engine", the engine's own ``small_batch_gemm`` with its one setting (to
16 rows): each the best of its tiles per case, its output checked before it is timed, each figure
with its share of the copy rate on the weight's bytes. What each probe asks: ``gemm_probes.py``.
``--small-batch`` times ``small_batch_gemm`` over ``SMALL_BATCH_TILES`` (to 16 rows), its default
first (two warps; with SwiGLU its own tile): one warp a program reads the shared-memory tiles
fewer times over, four read x's twice over (2 x 2 warps), wider N tiles read x's once for more of
w; and at one row ``gemm_probes.py``'s CUDA-core GEMV ("fma") over ``FMA_TILES``.

A second row for gate_up, "gate_up+silu", sets cuBLAS (and cuBLASLt) followed by the engine's
SwiGLU kernel against the engine's GEMM with SwiGLU in its epilogue (``gate_up_silu``, gate
and up rows interleaved), with its default tile and, with ``--fused-tiles``, the best of
``FUSED_TILES``.
"""

import argparse
from functools import partial

import torch
import torch.nn.functional as F
import triton

from benchmarks.cuda_graphs import graph_us
from benchmarks.gemm_probes import (
    FMA_TILES,
    MID_SPLITK_TILES,
    SPLITK_TILES,
    TILES,
    fma_linear,
    gemv_linear,
    triton_linear,
)
from nanovllm.demo_models import SHAPES
from nanovllm.kernels.gate_up_silu import gate_up_silu
from nanovllm.kernels.silu_and_mul import silu_and_mul
from nanovllm.kernels.small_batch_gemm import MAX_ROWS, small_batch_gemm

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, warp-specialised) for gate_up_silu
FUSED_TILES = [
    (128, 128, 64, 4, 4, False),
    (128, 128, 64, 8, 4, False),
    (128, 256, 64, 8, 3, False),
    (256, 128, 64, 8, 3, False),
    (128, 128, 128, 8, 3, False),
    (64, 256, 64, 4, 4, False),
    (128, 128, 64, 4, 4, True),
    (128, 256, 64, 8, 3, True),
]


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of small_batch_gemm, as the probes' tiles (its BLOCK_M
# is always 16); None: its defaults (16 x 512, 2 warps, 3 stages; with SwiGLU 32 x 256, 2 warps, 4)
SMALL_BATCH_TILES = [None] + [
    (16, *tile)
    for tile in [
        (16, 512, 4, 3), (16, 512, 2, 4), (16, 512, 1, 4), (16, 1024, 2, 2), (16, 256, 2, 6),
        (16, 256, 1, 6), (32, 512, 2, 3), (32, 256, 2, 4), (32, 512, 4, 3),
    ]
]  # fmt: skip


def engine_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: None) -> torch.Tensor:
    """The engine's ``small_batch_gemm`` with its one setting, called as the probes are."""
    return small_batch_gemm(x, w)


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection."""
    c = SHAPES[shape]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    h, i = c["hidden_size"], c["intermediate_size"]
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * i), "down": (i, h)}


def linear_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(F.linear(x, w))


def time_library(library: str, xs, ws, rep_ms: int, swiglu: bool = False) -> float:
    torch.backends.cuda.preferred_blas_library(library)
    try:
        return graph_us([partial(linear_silu if swiglu else F.linear, x, w) for x, w in zip(xs, ws)], rep_ms)
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


def checked_tiles(linear, x, w, out, expected, tiles):
    """The tiles whose output of ``linear(x, w, out, tile)`` matches ``expected``; a tile that
    does not compile or fit here is skipped (with a note when it does not compile)."""
    for tile in tiles:
        try:
            got = linear(x, w, out, tile).float()
        except triton.runtime.errors.OutOfResources:
            continue
        except (triton.compiler.errors.CompilationError, RuntimeError) as e:
            print(f"  tile {tile} does not compile: {str(e).splitlines()[-1]}")
            continue
        err = (got - expected).abs().max().item() / expected.abs().max().item()
        if err > 2e-2:
            raise AssertionError(f"{linear.__name__} off by {err:.3g} (relative) with tile {tile}")
        yield tile


def time_triton(xs, ws, rep_ms: int, linear=triton_linear, tiles=TILES) -> tuple[float, tuple]:
    """Best microseconds of ``linear`` over ``tiles`` (each checked against cuBLAS first; None:
    a kernel's own setting), and its tile."""
    outs = [torch.empty(x.shape[0], ws[0].shape[0], dtype=x.dtype, device=x.device) for x in xs]
    expected = F.linear(xs[0], ws[0]).float()
    k, split = xs[0].shape[1], lambda t: (*t, 1)[5]  # split-K tiles: 6 entries
    tiles = [t for t in tiles if t is None or k % (t[2] * split(t)) == 0]
    best = (float("inf"), None)
    for tile in checked_tiles(linear, xs[0], ws[0], outs[0], expected, tiles):
        calls = [partial(linear, x, w, o, tile) for x, w, o in zip(xs, ws, outs)]
        best = min(best, (graph_us(calls, rep_ms), tile), key=lambda t: t[0])
    return best


def time_gate_up_silu(xs, ws, rep_ms: int, tiles) -> tuple[float, tuple]:
    """Best microseconds of the engine's ``gate_up_silu`` over ``tiles`` (None: its own)."""
    expected = linear_silu(xs[0], ws[0]).float()
    best = (float("inf"), None)
    for tile in checked_tiles(lambda x, w, _, t: gate_up_silu(x, w, t), xs[0], ws[0], None, expected, tiles):
        calls = [partial(gate_up_silu, x, w, tile) for x, w in zip(xs, ws)]
        best = min(best, (graph_us(calls, rep_ms), tile), key=lambda t: t[0])
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="16,256,384,512,1024,16384")
    parser.add_argument("--layers", type=int, default=8, help="layers' weights per graph")
    parser.add_argument("--libraries", default="cublas,cublaslt")
    parser.add_argument("--triton", action="store_true", help="also time a plain Triton GEMM")
    parser.add_argument("--fused-tiles", action="store_true", help="sweep gate_up_silu's tiles")
    parser.add_argument("--splitk", action="store_true", help="also time a split-K GEMM")
    parser.add_argument("--small-batch", action="store_true", help="sweep small_batch_gemm's tiles")
    parser.add_argument("--copy-gbps", type=float, default=4300.0, help="the GPU's copy rate, GB/s")
    parser.add_argument("--rep-ms", type=int, default=100)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    libraries = args.libraries.split(",")
    # (kind, linear, its tiles at a row count: None where it does not take that many rows)
    kernels = [("triton", triton_linear, lambda rows: TILES)] if args.triton else []
    if args.splitk:
        kernels += [
            ("splitk", triton_linear, lambda rows: SPLITK_TILES if rows <= MAX_ROWS else MID_SPLITK_TILES),
            ("gemv", gemv_linear, lambda rows: SPLITK_TILES if rows <= MAX_ROWS else None),
            (
                "engine",
                lambda x, w, out, tile: small_batch_gemm(x, w),
                lambda rows: [None] if rows <= MAX_ROWS else None,
            ),
        ]
    if args.small_batch:
        kernels.append(
            (
                "small-batch",
                lambda x, w, out, tile: small_batch_gemm(x, w, tile=tile and tile[1:]),
                lambda rows: SMALL_BATCH_TILES if rows <= MAX_ROWS else None,
            )
        )
        kernels.append(("fma", fma_linear, lambda rows: FMA_TILES if rows == 1 else None))
    dims = projections(args.shape)
    ws = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(args.layers)]
          for name, (k, n) in dims.items()}  # fmt: skip
    print(f"{torch.cuda.get_device_name()}, {args.shape}, {args.layers} layers' weights per graph")
    for rows in map(int, args.rows.split(",")):
        totals: dict[str, float] = {}
        flops = 0
        for name, (k, n) in dims.items():
            xs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
            flop = 2 * rows * k * n
            flops += flop
            cells = []
            read = 2 * k * n / args.copy_gbps / 1e3  # µs to read the weight at the copy rate
            for library in libraries:
                us = time_library(library, xs, ws[name], args.rep_ms)
                totals[library] = totals.get(library, 0.0) + us
                cells.append(f"{library} {us:8.1f} us {flop / us / 1e6:4.0f} TFLOP/s {read / us:4.0%} copy")
            for kind, linear, tiles_at in kernels:
                if (tiles := tiles_at(rows)) is None:
                    continue
                us, tile = time_triton(xs, ws[name], args.rep_ms, linear=linear, tiles=tiles)
                totals[kind] = totals.get(kind, 0.0) + us
                cells.append(
                    f"{kind} {us:8.1f} us {flop / us / 1e6:4.0f} TFLOP/s {read / us:4.0%} copy {tile}"
                )
            print(f"rows {rows:6d} {name:8s} " + " | ".join(cells), flush=True)
            if name == "gate_up":
                cells = []
                for library in libraries:
                    us = time_library(library, xs, ws[name], args.rep_ms, swiglu=True)
                    cells.append(f"{library}+silu {us:8.1f} us")
                us, _ = time_gate_up_silu(xs, ws[name], args.rep_ms, [None])
                cells.append(f"fused {us:8.1f} us")
                if args.fused_tiles:
                    us, tile = time_gate_up_silu(xs, ws[name], args.rep_ms, FUSED_TILES)
                    cells.append(f"fused, best tile {us:8.1f} us {tile}")
                print(f"rows {rows:6d} gate_up+silu " + " | ".join(cells), flush=True)
        summary = ", ".join(
            f"{lib} {us:.1f} us ({us / rows:.3f} us a row, {flops / us / 1e6:.0f} TFLOP/s)"
            for lib, us in totals.items()
        )
        print(f"rows {rows:6d} all four: {summary}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
