"""Triton GEMMs that probe what cuBLAS leaves at a decode step's row counts (``bench_gemm.py``
times them): a plain tiled GEMM (could a kernel that also takes the RMSNorm before it or the
residual add after it match cuBLAS at all?), split-K with its fp32 shares added by a second
kernel (is reading the weight where cuBLAS loses time at 1-16 rows, or are too few output tiles
at 17-256?), and split-K in one launch ("gemv": the last program of a column tile adds the
shares in order, so no second kernel and no run-to-run difference), and a GEMV on CUDA cores for
one row ("fma": no tensor cores and no shared memory, so nothing caps the weight's stream but
the loads in flight; is a batch-1 step's GEMM bound by shared memory?). Probes, not the engine's
code: ``x @ w.T`` for contiguous ``x [M, K]`` and ``w [N, K]`` into ``out``, with the tiles below.
"""

import torch
import triton
import triton.language as tl

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


# (rows: 1, BLOCK_N, BLOCK_K, warps, AHEAD + 1) for fma_linear: AHEAD loads the next K step's
# weights before the products of this one (two steps in flight)
FMA_TILES = [
    (1, bn, bk, warps, stages)
    for bn, bk, warps in [(16, 512, 4), (16, 1024, 8), (32, 512, 8), (8, 1024, 4), (16, 256, 2)]
    for stages in (1, 2)
]  # fmt: skip


@triton.jit
def _fma_gemv_kernel(
    x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr
):
    # one row: the products summed elementwise across K steps and reduced once at the end; x is
    # loaded broadcast to w's tile shape so both share one register layout (no conversion a step)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    x_ptrs = x_ptr + offs_n[:, None] * 0 + offs_k
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k
    cols = offs_n[:, None] < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if AHEAD:
        w = tl.load(w_ptrs, mask=cols & (offs_k < K), other=0.0)
    for k in range(0, K, BLOCK_K):
        if AHEAD:
            w_next = tl.load(w_ptrs + BLOCK_K, mask=cols & (offs_k < K - k - BLOCK_K), other=0.0)
        else:
            w = tl.load(w_ptrs, mask=cols & (offs_k < K - k), other=0.0)
        x = tl.load(x_ptrs, mask=offs_k < K - k, other=0.0)
        acc += x.to(tl.float32) * w.to(tl.float32)
        if AHEAD:
            w = w_next
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(out_ptr + offs_n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=offs_n < N)


def fma_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: tuple) -> torch.Tensor:
    """``tile``: ``FMA_TILES``' five entries; one row."""
    (M, K), N = x.shape, out.shape[1]
    if M != 1:
        raise ValueError(f"fma_linear takes one row, not {M}")
    _, bn, bk, warps, stages = tile
    _fma_gemv_kernel[(triton.cdiv(N, bn),)](
        x, w, out, N, K, BLOCK_N=bn, BLOCK_K=bk, AHEAD=stages > 1, num_warps=warps, num_stages=1
    )
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
