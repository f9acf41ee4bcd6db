"""SwiGLU's gate/up projection with the activation in the GEMM's epilogue.

The weight holds gate and up rows interleaved (row ``2j`` gate ``j``, row ``2j + 1`` up ``j``),
so every output tile of ``x @ w.T`` holds matching gate and up columns in one accumulator: the
epilogue splits them and writes ``silu(gate) * up``, half the product's width, and the
``[tokens, 2 * size]`` intermediate never reaches memory. One program per SM walks the output
tiles; x and w tiles arrive through tensor descriptors (TMA on Hopper).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.device import capability, num_sms, pdl_options, wait_for_prior_grid
from nanovllm.kernels.silu_and_mul import silu_and_mul_ref

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, warp-specialised): the best of a sweep on H200 at
# 512-16,384 rows of Qwen3-8B's MLP.
TILE = (128, 256, 64, 8, 3, False)
_GROUP_M = 8  # row tiles per column tile in the launch order, so weight tiles are shared in L2
# The kernel's tiles run in waves of one per SM. Against cuBLAS + the SwiGLU kernel on H200 it
# won or tied wherever the useful part of those waves' tiles was 0.97, lost 1.6% at 0.87
# (Qwen3-8B, 768 rows) and 7-30% at 0.73 and below (-0.6B at 256-1,024 rows, -8B at 256-384).
_MIN_WAVE_USE = 0.8


def gate_up_silu_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference. ``x``: ``[tokens, hidden]``; ``weight``: ``[2 * size, hidden]``,
    gate and up rows interleaved. Returns ``[tokens, size]``: silu(gate) * up, the projection,
    silu and the product each rounded to ``x.dtype`` as Hugging Face's MLP rounds them."""
    return silu_and_mul_ref(F.linear(x, weight))


@triton.jit
def swiglu_of_pairs(acc, dtype: tl.constexpr):
    """``[rows, 2 * size]`` fp32 products, gate and up columns interleaved, to ``[rows, size]``
    ``silu(gate) * up`` in ``dtype``, rounded where the reference rounds: the projection, silu,
    the product."""
    gate, up = tl.split(tl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2)))
    gate, up = gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit(do_not_specialize=["M", "num_programs"])  # a step's size: no new variant
def _gate_up_silu_kernel(
    x_desc, w_desc, out_desc, M, N, K, num_programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior_grid(PDL)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    for tile in tl.range(
        tl.program_id(0), tiles_m * tiles_n, num_programs, flatten=True, warp_specialize=WARP_SPECIALIZE
    ):
        first_m = (tile // per_group) * GROUP_M
        rows_in_group = min(tiles_m - first_m, GROUP_M)
        off_m = (first_m + (tile % per_group) % rows_in_group) * BLOCK_M
        off_n = ((tile % per_group) // rows_in_group) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc)
        out_desc.store([off_m, off_n // 2], swiglu_of_pairs(acc, out_desc.dtype))


def _block_n(n: int, block_n: int = TILE[1]) -> int:
    return min(block_n, triton.next_power_of_2(n))


def gate_up_silu_pays(rows: int, n: int, sms: int) -> bool:
    """Whether the kernel beats cuBLAS + the SwiGLU kernel for ``rows`` x ``n`` (``2 * size``)
    outputs on ``sms`` SMs: whether its tiles, in waves of ``sms``, are mostly useful work."""
    block_n = _block_n(n)
    tiles = triton.cdiv(rows, TILE[0]) * triton.cdiv(n, block_n)
    slots = triton.cdiv(tiles, sms) * sms * TILE[0] * block_n
    return rows * n >= _MIN_WAVE_USE * slots


def gate_up_silu_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`gate_up_silu` takes these inputs: fp16/bf16, contiguous, starting and
    with rows in whole 16-byte units (the tensor descriptors' alignment), on a GPU with TMA
    (sm_90+)."""
    return (
        x.dim() == 2
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.shape[1] % 8 == 0
        and weight.shape[0] % 16 == 0
        and x.data_ptr() % 16 == 0
        and weight.data_ptr() % 16 == 0
        and (x.device.type != "cuda" or capability(x.device)[0] >= 9)
    )


def gate_up_silu_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs and pays at their size."""
    return gate_up_silu_supported(x, weight) and gate_up_silu_pays(
        x.shape[0], weight.shape[0], num_sms(x.device)
    )


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, tile: tuple | None = None) -> torch.Tensor:
    """Triton version of :func:`gate_up_silu_ref` (same semantics) for inputs it supports
    (:func:`gate_up_silu_supported`); ``tile`` as :data:`TILE` (default)."""
    if not gate_up_silu_supported(x, weight):
        raise ValueError("gate_up_silu needs contiguous fp16/bf16 inputs whose rows are 16-byte multiples")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[1]} input features, x {x.shape[1]}")
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n // 2, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk, warps, stages, warp_specialize = tile or TILE
    bn = _block_n(n, bn)
    programs = min(num_sms(x.device), triton.cdiv(m, bm) * triton.cdiv(n, bn))
    _gate_up_silu_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(weight, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn // 2]),
        m, n, k, programs,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=_GROUP_M, WARP_SPECIALIZE=warp_specialize,
        num_warps=warps, num_stages=stages, **pdl_options(x.device),
    )  # fmt: skip
    return out
