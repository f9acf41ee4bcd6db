"""SwiGLU with its gate/up projection: one column-parallel GEMM, then silu(gate) * up."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.fp8 import FP8, GROUP
from nanovllm.kernels.gate_up_silu import gate_up_silu, gate_up_silu_fits, gate_up_silu_ref
from nanovllm.kernels.silu_and_mul import (
    silu_and_mul,
    silu_and_mul_fp8,
    silu_and_mul_fp8_ref,
)
from nanovllm.kernels.small_batch_gemm import small_batch_gemm, small_batch_gemm_pays
from nanovllm.layers.fp8 import QuantizedActivation
from nanovllm.layers.linear import ColumnParallelLinear
from nanovllm.layers.parallel import TPGroup, copy_weight, shard_of


class GateUpSwiGLU(ColumnParallelLinear):
    """``silu(x @ gate.T) * (x @ up.T)`` from Hugging Face's ``gate_proj`` and ``up_proj``.

    The weight stores their rows interleaved (gate ``j`` at ``2j``, up ``j`` at ``2j + 1``; each
    rank its own slice of both), so a GEMM output tile holds matching gate and up columns and
    the kernel with SwiGLU in its epilogue can take sizes where it pays; the others keep cuBLAS
    and a separate SwiGLU kernel. An FP8 checkpoint's 128 x 128 blocks keep gate and up side by
    side instead (``halves``: each 128-row block of the weight one block of the checkpoint's, as
    cuBLAS's block-scaled product wants).
    """

    def __init__(
        self, input_size: int, intermediate_size: int, tp: TPGroup = TPGroup(), quant: str | None = None
    ):
        self.halves = quant == "fp8_block"
        super().__init__(input_size, 2 * intermediate_size, False, tp, quant)

    def rows_in_whole_blocks(self, output_size: int) -> bool:
        return self.halves and output_size % (2 * GROUP) == 0

    def part_rows(self, shard_id: int) -> int:
        return self.weight.shape[0] // 2 * self.tp.size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        if self.halves:
            size = param.shape[0] // 2
            rows = param.data.narrow(0, shard_id * size, size)
        else:
            rows = param.data[shard_id::2]
        copy_weight(rows, shard_of(loaded, 0, self.tp, rows.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == FP8:
            # the down projection, FP8 too, takes its input rounded here: per token, or per token
            # and 128 features for block scales
            y = self.fp8_forward(x, None)
            swiglu_fp8 = silu_and_mul_fp8 if y.is_cuda else silu_and_mul_fp8_ref
            group = GROUP if self.halves else None
            rows = y.reshape(-1, y.shape[-1])
            return QuantizedActivation(*swiglu_fp8(rows, halves=self.halves, group=group), y.dtype)
        if not x.is_cuda:
            return gate_up_silu_ref(x, self.weight)
        if small_batch_gemm_pays(x, self.weight.shape[0], swiglu=True):
            return small_batch_gemm(x, self.weight, swiglu=True)
        if gate_up_silu_fits(x, self.weight):
            return gate_up_silu(x, self.weight)
        return silu_and_mul(F.linear(x, self.weight))
