"""The decoder's four projections at a step's row counts: cuBLAS, cuBLASLt and a plain Triton GEMM.

    PYTHONPATH=. python3 benchmarks/bench_gemm.py [--shape qwen3-8b] [--rows 256,1024] [--triton]
                                                   [--fused-tiles] [--splitk]

Each case is ``F.linear(x, w)`` (``w``: ``[out, in]``, as the checkpoint stores it) for qkv,
o, gate_up and down, timed as a CUDA-graph replay over ``--layers`` layers' weights, so no
layer finds its weights in L2, as in a decode step. Prints microseconds and TFLOP/s per
projection, and the four together per row of a layer.

``--triton`` also times a Triton GEMM with the tiles below (best per case, and its tile): it
asks whether a Triton kernel, which could take the RMSNorm before it or the residual add
after it, can match cuBLAS at these sizes at all. It is a probe, not the engine's code; its
output is checked before it is timed.

``--splitk`` (for small batches: ``--rows 1,2,4,8,16``) also times a split-K Triton GEMM with
one 16-row tile of rows (each program reads a slice of the weight's rows over a share of K, the
shares' fp32 partial sums then added by a second kernel): it asks whether reading the weight is
where cuBLAS loses time at batch 1 to 16, where a decode step is bound by reading the weights.
Above 16 rows it sweeps ``MID_SPLITK_TILES`` instead (32-256 rows in 32- to 256-row tiles, K in
1 to 8 shares): whether more programs than output tiles help where a projection's output is too
narrow to give every SM a tile (the 0.6B shape's o and down at 256 rows: 16 tiles of 128 x 128).
"gemv" is the same in one launch (the last program of a column tile adds the shares, in order,
so no second kernel and no run-to-run difference), as cuBLAS's split-K GEMMs need a reduce
kernel after them. Also probes; each figure comes with its share of the copy rate on the
weight's bytes. "engine" is the engine's own ``small_batch_gemm`` with its one setting.

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
import triton.language as tl
from triton.testing import do_bench

from nanovllm.demo_models import SHAPES
from nanovllm.kernels.gate_up_silu import gate_up_silu
from nanovllm.kernels.silu_and_mul import silu_and_mul
from nanovllm.kernels.small_batch_gemm import MAX_ROWS, small_batch_gemm

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
TILES = [
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3),
    (64, 256, 64, 8, 3),
    (128, 64, 64, 4, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (128, 128, 128, 8, 3),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
]

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


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT): K is cut into SPLIT shares
SPLITK_TILES = [
    (16, bn, bk, warps, stages, split)
    for bn, bk, warps, stages, split in [
        (16, 256, 4, 4, 1), (16, 512, 4, 3, 1), (16, 512, 8, 4, 1), (32, 512, 4, 3, 1),
        (32, 256, 4, 4, 1), (64, 128, 4, 4, 1), (64, 256, 4, 3, 1), (128, 128, 8, 3, 1),
        (32, 256, 4, 4, 2), (64, 128, 4, 4, 2), (64, 256, 4, 3, 2), (128, 128, 8, 3, 2),
        (32, 256, 4, 4, 4), (64, 128, 4, 4, 4), (64, 256, 8, 3, 4), (32, 512, 4, 3, 4),
        (32, 128, 4, 4, 8), (64, 128, 4, 4, 8), (32, 256, 4, 3, 8),
    ]
]  # fmt: skip


# the same for 17-256 rows: row tiles of 32-256, shares of K from 1 to 8
MID_SPLITK_TILES = [
    (bm, bn, bk, warps, stages, split)
    for bm, bn, bk, warps, stages in [
        (64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3),
        (64, 64, 64, 4, 4), (32, 64, 128, 4, 4), (32, 128, 128, 4, 3), (256, 64, 64, 8, 3),
    ]
    for split in (1, 2, 4, 8)
]  # fmt: skip


@triton.jit
def _share_product(x_ptr, w_ptr, offs_m, offs_n, M, N, K, share, K_SHARE, BLOCK_K: tl.constexpr):
    """fp32 ``x[offs_m] @ w[offs_n].T`` over K share ``share`` (``K_SHARE`` features, a multiple
    of BLOCK_K); x and w contiguous."""
    offs_k = share * K_SHARE + tl.arange(0, BLOCK_K)
    x_tile = x_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_tile = w_ptr + offs_n[:, None] * K + offs_k[None, :]
    acc = tl.zeros((offs_m.shape[0], offs_n.shape[0]), dtype=tl.float32)
    for _ in range(0, K_SHARE, BLOCK_K):
        x = tl.load(x_tile, mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_tile, mask=offs_n[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    return acc


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, K_SHARE,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PARTIAL: tl.constexpr,
):  # fmt: skip
    # out = x @ w.T, all contiguous; program (tile, share) sums K share ``share`` (K_SHARE, a
    # multiple of BLOCK_K); PARTIAL: fp32 sums into out[share] ([SPLIT, M, N]), else the result.
    # Programs walk GROUP_M row tiles per column tile so that neighbours share weight tiles in L2.
    pid, share = tl.program_id(0), tl.program_id(1)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _share_product(x_ptr, w_ptr, offs_m, offs_n, M, N, K, share, K_SHARE, BLOCK_K)
    out = out_ptr + share * M * N + offs_m[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out, acc if PARTIAL else acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_shares_kernel(part_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for share in range(SPLIT):
        acc += tl.load(part_ptr + share * numel + offs, mask=offs < numel, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < numel)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, part_ptr, count_ptr, out_ptr, M, N, K, K_SHARE,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    # out = x @ w.T for M <= BLOCK_M rows, one launch: program (column tile, share) sums its K
    # share into part[share] (fp32); the last of a column tile's SPLIT programs to finish (a
    # counter per tile, reset by that program for the next launch) adds the shares in order,
    # so the result does not depend on which program finished when.
    pid_n, share = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _share_product(x_ptr, w_ptr, offs_m, offs_n, M, N, K, share, K_SHARE, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tile = offs_m[:, None] * N + offs_n[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + share * M * N + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's share stored before the counter says so
        if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel") == SPLIT - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT):
                acc += tl.load(part_ptr + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(count_ptr + pid_n, 0)


_GEMV_WORKSPACE: dict = {}


def gemv_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: tuple) -> torch.Tensor:
    """``tile``: ``SPLITK_TILES``' six entries (BLOCK_M 16: rows <= 16), one launch."""
    (M, K), N = x.shape, out.shape[1]
    if M > 16:
        raise ValueError(f"gemv_linear takes up to 16 rows, not {M}")
    _, bn, bk, warps, stages, split = tile
    key = (x.device, M, N, bn, split)
    if key not in _GEMV_WORKSPACE:  # made outside the timed graph: the first call is untimed
        _GEMV_WORKSPACE[key] = (
            torch.empty(split, M, N, dtype=torch.float32, device=x.device),
            torch.zeros(triton.cdiv(N, bn), dtype=torch.int32, device=x.device),
        )
    part, count = _GEMV_WORKSPACE[key]
    _gemv_kernel[(triton.cdiv(N, bn), split)](
        x, w, part, count, out, M, N, K, K // split, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
        SPLIT=split, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def triton_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: tuple) -> torch.Tensor:
    """``tile``: ``TILES``' five entries, or ``SPLITK_TILES``' six (K cut into SPLIT shares,
    their fp32 sums added by a second kernel)."""
    (M, K), N = x.shape, out.shape[1]
    bm, bn, bk, warps, stages, split = (*tile, 1)[:6]
    target = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _gemm_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn), split)](
        x, w, target, M, N, K, K // split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        PARTIAL=split > 1, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split > 1:
        _sum_shares_kernel[(triton.cdiv(M * N, 1024),)](target, out, M * N, SPLIT=split, BLOCK=1024)
    return out


def projections(shape: str) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection."""
    c = SHAPES[shape]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    h, i = c["hidden_size"], c["intermediate_size"]
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * i), "down": (i, h)}


def graph_us(calls: list, rep_ms: int) -> float:
    """Median microseconds per call of ``calls`` replayed as one CUDA graph."""
    calls[0]()  # compile and pick algorithms outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return do_bench(graph.replay, rep=rep_ms, return_mode="median") * 1e3 / len(calls)


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
    parser.add_argument("--copy-gbps", type=float, default=4300.0, help="the GPU's copy rate, GB/s")
    parser.add_argument("--rep-ms", type=int, default=100)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    libraries = args.libraries.split(",")
    kernels = [("triton", triton_linear, TILES)] if args.triton else []
    if args.splitk:
        # the split-K tiles by rows: SPLITK_TILES up to 16, MID_SPLITK_TILES above
        kernels += [("splitk", triton_linear, None), ("gemv", gemv_linear, SPLITK_TILES)]
        kernels += [("engine", lambda x, w, out, tile: small_batch_gemm(x, w), [None])]
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
            for kind, linear, tiles in kernels:
                if kind in ("gemv", "engine") and rows > MAX_ROWS:
                    continue
                if kind == "splitk":
                    tiles = SPLITK_TILES if rows <= 16 else MID_SPLITK_TILES
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
