"""Linear layers sharded for tensor parallelism, each parameter with its ``weight_loader``."""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.kernels.fp8 import FP8, GROUP
from nanovllm.kernels.small_batch_gemm import small_batch_gemm, small_batch_gemm_pays
from nanovllm.layers.fp8 import (
    PER_ROW_SCALED,
    block_scales_per_row,
    fp8_block_linear,
    fp8_linear,
    quantize_weight,
    quantize_weight_blocks,
)
from nanovllm.layers.parallel import TPGroup, copy_weight, divide, shard_of


class LinearBase(nn.Module):
    """``y = x W^T (+ b)`` with W sharded along ``tp_dim`` (0: output, 1: input, None: whole)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp: TPGroup,
        tp_dim: int | None,
        quant: str | None = None,
    ):
        super().__init__()
        self.tp, self.tp_dim = tp, tp_dim
        if quant == "fp8_block":  # see layers/fp8.py
            self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8), requires_grad=False)
            groups = -(-input_size // GROUP)
            rows = output_size // GROUP if self.rows_in_whole_blocks(output_size) else output_size
            scale_inv = torch.ones(rows, groups, dtype=torch.float32)  # float32 whatever the model dtype
            self.weight_scale_inv = nn.Parameter(scale_inv, requires_grad=False)
            self.weight.weight_loader = self.fp8_block_weight_loader
            self.weight_scale_inv.weight_loader = self.fp8_block_scale_loader
        elif quant in PER_ROW_SCALED:
            self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8), requires_grad=False)
            scale = torch.ones(output_size, dtype=torch.float32)
            self.weight_scale = nn.Parameter(scale, requires_grad=False)
            if quant == "fp8":
                self.weight_scale.derived = True  # written with the weight: no checkpoint tensor of its own
                self.weight.weight_loader = self.fp8_weight_loader
            else:  # an FP8 checkpoint's per-tensor scale, kept per output row like quantize-at-load's
                self.weight.weight_loader = self.fp8_tensor_weight_loader
                self.weight_scale.weight_loader = self.fp8_tensor_scale_loader
        else:
            self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def rows_in_whole_blocks(self, output_size: int) -> bool:
        """Whether each 128 rows of this rank's weight are rows of one 128 x 128 block of an FP8
        checkpoint's tensor (their scales then kept one row per block, as stored)."""
        return output_size % GROUP == 0

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp_dim is not None and not (self.tp_dim == 1 and param.dim() == 1):
            loaded = shard_of(loaded, self.tp_dim, self.tp, param.shape[self.tp_dim])
        copy_weight(param.data, loaded)

    def fp8_weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
        """Quantize a checkpoint weight (per output channel, over whole rows), then route the FP8
        rows and their scales as the model-dtype weight's loader routes its rows (quantized where
        the parameter lives: on the GPU, not the host's cores)."""
        weight, scale = quantize_weight(loaded if param.is_meta else loaded.to(param.device))
        type(self).weight_loader(self, param, weight, *shard_id)
        target = (
            self.weight_scale if not param.is_meta else torch.empty_like(self.weight_scale, device="meta")
        )
        type(self).weight_loader(self, target, scale, *shard_id)

    def fp8_tensor_weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
        """An FP8 checkpoint's e4m3 weight as stored; a model-dtype one (a weight update) quantized
        per output channel, its scales written with it."""
        if loaded.dtype != FP8:
            self.fp8_weight_loader(param, loaded, *shard_id)
        else:
            type(self).weight_loader(self, param, loaded, *shard_id)

    def fp8_tensor_scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
        """A checkpoint's one ``weight_scale`` for a whole tensor, given to each of its rows."""
        if loaded.numel() != 1:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected one scale for the whole tensor")
        rows = loaded.float().reshape(1).expand(self.part_rows(*shard_id))
        type(self).weight_loader(self, param, rows, *shard_id)

    def part_rows(self, *shard_id) -> int:
        """Output rows of the checkpoint tensor that ``shard_id`` names (all ranks' together)."""
        return self.weight.shape[0] * (self.tp.size if self.tp_dim == 0 else 1)

    def fp8_block_weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
        """An FP8 checkpoint's weight as stored; a model-dtype one (a weight update) quantized
        by 128 x 128 blocks first, its scales loaded with it."""
        if loaded.dtype != FP8:
            loaded, scale_inv = quantize_weight_blocks(loaded if param.is_meta else loaded.to(param.device))
            target = torch.empty_like(self.weight_scale_inv, device="meta") if param.is_meta else None
            self.fp8_block_scale_loader(target, scale_inv, *shard_id)
        type(self).weight_loader(self, param, loaded, *shard_id)

    def fp8_block_scale_loader(self, param: nn.Parameter | None, loaded: torch.Tensor, *shard_id) -> None:
        """A checkpoint's ``weight_scale_inv`` blocks, spread to one row per output row and routed
        as the weight's rows are (a part's rows must be a multiple of 128); kept per row, or per
        block again where this rank's rows come in whole blocks."""
        param = self.weight_scale_inv if param is None else param
        if param.shape[0] == self.weight.shape[0]:
            type(self).weight_loader(self, param, block_scales_per_row(loaded), *shard_id)
            return
        rows = block_scales_per_row(param.data)  # the other parts' scales kept as they are
        type(self).weight_loader(self, rows, block_scales_per_row(loaded), *shard_id)
        if not param.is_meta:
            param.data.copy_(rows[::GROUP])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == FP8:
            return self.fp8_forward(x, self.bias)
        return self.dense_forward(x, self.bias)

    def dense_forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The product with a model-dtype weight: at decode sizes, where it pays, the kernel that
        streams the weight in one launch; cuBLAS otherwise."""
        if small_batch_gemm_pays(x, self.weight.shape[0]):
            return small_batch_gemm(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def fp8_forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if hasattr(self, "weight_scale_inv"):
            return fp8_block_linear(x, self.weight, self.weight_scale_inv, bias)
        return fp8_linear(x, self.weight, self.weight_scale, bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup = TPGroup()):
        super().__init__(input_size, output_size, bias, tp, None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TPGroup = TPGroup(),
        quant: str | None = None,
    ):
        super().__init__(input_size, divide(output_size, tp.size), bias, tp, 0, quant)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections; heads split across ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: TPGroup = TPGroup(),
        quant: str | None = None,
    ):
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.size)
        self.num_kv_heads = divide(num_kv_heads, tp.size)
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, tp, quant)

    def rows_in_whole_blocks(self, output_size: int) -> bool:
        return self.num_heads * self.head_dim % GROUP == 0 and self.num_kv_heads * self.head_dim % GROUP == 0

    def part_rows(self, shard_id: str) -> int:
        heads = self.num_heads if shard_id == "q" else self.num_kv_heads
        return heads * self.head_dim * self.tp.size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        copy_weight(param.data.narrow(0, offset, size), shard_of(loaded, 0, self.tp, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs summed with an all-reduce."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp: TPGroup = TPGroup(),
        quant: str | None = None,
    ):
        super().__init__(divide(input_size, tp.size), output_size, bias, tp, 1, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the bias is added once, after the reduction
        if self.weight.dtype == FP8:
            y = self.tp.all_reduce(self.fp8_forward(x, None))
        else:
            y = self.tp.all_reduce(self.dense_forward(x, None))
        return y + self.bias if self.bias is not None else y
