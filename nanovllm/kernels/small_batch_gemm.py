"""``x @ w.T (+ b)`` for decode-sized batches (up to 16 rows), where a step is bound by reading
the weights: one 16-row tile of rows, each program streaming ``BLOCK_N`` of the weight's rows
over all of K. The weight is read once, in one launch, with no split-K reduce after it (cuBLAS
cuts K for the 8B's o and down projections at these sizes and adds a reduce kernel each); the
sum over K runs in one order whatever the batch holds. Worth it only where the weight's rows
give every SM a program (:func:`small_batch_gemm_pays`); cuBLAS elsewhere, and for the LM head,
whose wide weight cuBLAS streams at the copy rate.

Two warps a program: the 16 x ``BLOCK_N`` product is laid over them as ``[1, 2]``, each warp
reading all of x's shared tile and its own half of w's, ~5 bytes of shared-memory traffic per
weight byte; four warps (``[2, 2]``) read each tile twice over, ~8 bytes, about all an SM has at
the H200's memory rate (``benchmarks/MEASUREMENTS.md``).

On by default; ``NANOVLLM_SMALL_BATCH_GEMM=0`` in the environment keeps cuBLAS at every size.
It shortens the 8B's batch-1 and 16-row decode steps by 4% and 3% on an H200 and by 6% on an
H100 (the four-warp tile before it lengthened them by 11% on the H200)."""

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.kernels.device import num_sms, pdl_options, wait_for_prior_grid
from nanovllm.kernels.gate_up_silu import gate_up_silu_ref, swiglu_of_pairs

MAX_ROWS = 16  # one tile of rows: tl.dot's smallest
# (BLOCK_N weight rows per program, BLOCK_K features per step, warps, stages): 16 KB of a bf16
# weight in flight per stage; with SwiGLU 32 rows, 16 output columns, in 8 KB steps
_TILE = (16, 512, 2, 3)
_SWIGLU_TILE = (32, 256, 2, 4)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ENABLED = os.environ.get("NANOVLLM_SMALL_BATCH_GEMM", "1") != "0"


def small_batch_gemm_ref(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, swiglu: bool = False
) -> torch.Tensor:
    """``F.linear(x, w, bias)``: ``x`` ``[rows, in]``, ``w`` ``[out, in]`` as checkpoints store it;
    ``swiglu``: then SwiGLU of its interleaved gate and up columns."""
    return gate_up_silu_ref(x, w) if swiglu else F.linear(x, w, bias)


def _default_tile(swiglu: bool) -> tuple[int, int, int, int]:
    return _SWIGLU_TILE if swiglu else _TILE


def small_batch_gemm_pays(x: torch.Tensor, out_features: int, swiglu: bool = False) -> bool:
    """Whether :func:`small_batch_gemm` (with ``swiglu`` or not) should take ``x`` (``[rows,
    in]``) times a weight of ``out_features`` rows: when enabled (``ENABLED``), 1-16 rows of a
    16-bit dtype on a CUDA device, and a program for every SM without cutting K."""
    return (
        ENABLED
        and x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and out_features >= _default_tile(swiglu)[0] * num_sms(x.device)
    )


@triton.jit(do_not_specialize=["M"])  # one variant for 1-16 rows: no compile when a batch size is new
def _small_batch_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm,
    HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior_grid(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_tile = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    rows, cols = offs_m[:, None] < M, offs_n[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_tile, mask=rows, other=0.0)
            w = tl.load(w_tile, mask=cols, other=0.0)
        else:
            in_k = offs_k[None, :] < K - k
            x = tl.load(x_tile, mask=rows & in_k, other=0.0)
            w = tl.load(w_tile, mask=cols & in_k, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:  # weight rows 2j, 2j + 1 (gate, up) give output column j
        offs_j = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out = out_ptr + offs_m[:, None] * (N // 2) + offs_j[None, :]
        tl.store(out, swiglu_of_pairs(acc, out_ptr.dtype.element_ty), mask=rows & (offs_j[None, :] < N // 2))
    else:
        out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rows & (offs_n[None, :] < N))


def small_batch_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    swiglu: bool = False,
    tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for ``x`` ``[rows, in]`` of 1-16 rows (unit stride along features),
    ``w`` ``[out, in]`` contiguous, both one of float32 / float16 / bfloat16; fp32 sums over K
    in steps of the tile's ``BLOCK_K``, rounded once to ``x.dtype``. ``swiglu``: ``w`` holds
    gate and up rows interleaved, and the result is ``silu(gate) * up``, ``[rows, out / 2]``, as
    :func:`~nanovllm.kernels.gate_up_silu.gate_up_silu_ref` rounds it. ``tile``: ``(BLOCK_N,
    BLOCK_K, num_warps, num_stages)`` in place of the default (``_TILE``, ``_SWIGLU_TILE``), for
    benchmarks."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x [rows, in] and w [out, in], got {tuple(x.shape)} and {tuple(w.shape)}")
    if not 0 < x.shape[0] <= MAX_ROWS:
        raise ValueError(f"small_batch_gemm takes 1 to {MAX_ROWS} rows, not {x.shape[0]}")
    if x.dtype not in _DTYPES or w.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, w and bias must share one of {_DTYPES}, not {x.dtype} and {w.dtype}")
    if x.stride(1) != 1 or not w.is_contiguous():
        raise ValueError("x needs unit stride along its features and w must be contiguous")
    (m, k), n = x.shape, w.shape[0]
    if swiglu and (n % 2 or bias is not None):
        raise ValueError(f"swiglu needs interleaved gate/up rows (an even count, not {n}) and no bias")
    block_n, block_k, num_warps, num_stages = tile or _default_tile(swiglu)
    out = torch.empty(m, n // 2 if swiglu else n, dtype=x.dtype, device=x.device)
    _small_batch_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, w, w if bias is None else bias, out, m, n, k, x.stride(0),
        HAS_BIAS=bias is not None, SWIGLU=swiglu, EVEN_K=k % block_k == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # tf32: ignored for 16-bit inputs
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(x.device),
    )  # fmt: skip
    return out
