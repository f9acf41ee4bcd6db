"""Mixture-of-experts SwiGLU experts, stacked per layer; tensor parallelism splits every
expert's intermediate size across ranks (no expert is split unevenly, no token is moved)."""

import torch
from torch import nn

from nanovllm.kernels.fused_moe import fused_moe, fused_moe_ref
from nanovllm.layers.parallel import TPGroup, copy_weight, divide, shard_of


class FusedMoE(nn.Module):
    """``w13`` ``[experts, 2 * intermediate / tp, hidden]`` (gate rows, then up rows) and ``w2``
    ``[experts, hidden, intermediate / tp]``, loaded from each expert's Hugging Face
    ``gate_proj`` / ``up_proj`` / ``down_proj``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        inter = divide(intermediate_size, tp.size)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int | None, int | None]
    ):
        """``shard_id``: (expert, 0 for gate / 1 for up / None for down); expert None: every
        expert at once, as transformers keeps them in memory (``gate_up_proj`` ``[experts,
        2 * intermediate, hidden]``, gate rows first; ``down_proj`` ``[experts, hidden,
        intermediate]``)."""
        expert, half = shard_id
        if expert is None:
            if half is None:
                copy_weight(param.data, shard_of(loaded, 2, self.tp, param.shape[2]))
                return
            inter = param.shape[1] // 2
            if loaded.dim() != 3 or loaded.shape[1] != 2 * inter * self.tp.size:
                raise ValueError(
                    f"has shape {tuple(loaded.shape)}, expected {2 * inter * self.tp.size} along dimension 1"
                )
            for part, rows in enumerate(loaded.chunk(2, dim=1)):
                copy_weight(
                    param.data[:, part * inter : (part + 1) * inter], shard_of(rows, 1, self.tp, inter)
                )
            return
        if half is None:
            copy_weight(param.data[expert], shard_of(loaded, 1, self.tp, param.shape[2]))
            return
        inter = param.shape[1] // 2
        copy_weight(
            param.data[expert, half * inter : (half + 1) * inter], shard_of(loaded, 0, self.tp, inter)
        )

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        moe = fused_moe if x.is_cuda else fused_moe_ref
        return self.tp.all_reduce(moe(x, self.w13, self.w2, topk_weights, topk_ids))
