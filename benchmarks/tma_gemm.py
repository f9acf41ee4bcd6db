"""A persistent Triton GEMM fed by tensor descriptors (TMA on Hopper), for ``bench_gemm.py --tma``.

``out = x @ w.T`` as :func:`bench_gemm.triton_linear` computes it, but one program per SM walks
the output tiles, and x and w tiles arrive through tensor descriptors, so no program computes
addresses or masks: the copy engine fetches tiles and zero-fills rows past M. The question it
answers: does a Triton GEMM built the way Hopper wants get close enough to cuBLAS that the
RMSNorm before a projection, or SwiGLU and the residual add after it, can live in the GEMM?
A probe, not the engine's code.
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.decode_reduce import num_sms

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, warp-specialised)
TMA_TILES = [
    (128, 128, 64, 4, 4, False),
    (128, 128, 64, 8, 4, False),
    (128, 256, 64, 8, 3, False),
    (256, 128, 64, 8, 3, False),
    (128, 128, 128, 8, 3, False),
    (64, 256, 64, 4, 4, False),
    (128, 128, 64, 4, 4, True),
    (128, 256, 64, 8, 3, True),
]


@triton.jit
def _tma_gemm_kernel(
    x_desc, w_desc, out_desc, M, N, K, num_programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SWIGLU: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    # Tiles go out GROUP_M row tiles per column tile, as in the plain kernel, so programs
    # working at once share weight tiles in L2. With SWIGLU, w holds 2N rows (gate, then up).
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_M * tiles_n
    for tile in tl.range(
        tl.program_id(0), tiles_m * tiles_n, num_programs, flatten=True, warp_specialize=WARP_SPECIALIZE
    ):
        first_m = (tile // per_group) * GROUP_M
        rows_in_group = min(tiles_m - first_m, GROUP_M)
        off_m = (first_m + (tile % per_group) % rows_in_group) * BLOCK_M
        off_n = ((tile % per_group) // rows_in_group) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(k_steps):
            off_k = step * BLOCK_K
            x = x_desc.load([off_m, off_k])
            acc = tl.dot(x, w_desc.load([off_n, off_k]).T, acc)
            if SWIGLU:
                acc_up = tl.dot(x, w_desc.load([off_n + N, off_k]).T, acc_up)
        dtype = out_desc.dtype
        if SWIGLU:  # rounded as the engine's GEMM and SwiGLU kernel round it
            gate, up = acc.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32)
            acc = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
        out_desc.store([off_m, off_n], acc.to(dtype))


def tma_linear(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: tuple, swiglu: bool = False
) -> torch.Tensor:
    """``out = x @ w.T`` (with ``swiglu``: ``silu(x @ gate.T) * (x @ up.T)``, w = [gate; up]);
    x, w and out contiguous. ``tile`` is one of :data:`TMA_TILES`."""
    (M, K), N = x.shape, out.shape[1]
    bm, bn, bk, warps, stages, ws = tile
    programs = min(num_sms(x.device), triton.cdiv(M, bm) * triton.cdiv(N, bn))
    _tma_gemm_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(w, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]),
        M, N, K, programs,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SWIGLU=swiglu,
        WARP_SPECIALIZE=ws, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
