"""Mixture-of-experts SwiGLU experts, stacked per layer; tensor parallelism splits every
expert's intermediate size across ranks (no expert is split unevenly, no token is moved).

With ``quantization="fp8"`` the experts' weights are held in float8 e4m3, quantized as they load
with one float32 scale per expert and output row, each row scaled over its whole length before
the tensor-parallel split (every rank agrees on a row's scale; ``down_proj``'s rows are split
along their length, so a rank keeps its slice of the whole row's e4m3 values and its scale).

An FP8 checkpoint's experts load as stored: with one scale per tensor (AutoFP8's dynamic
format) the e4m3 weights, each tensor's scale given to its rows (the ``quantization="fp8"``
layout); with ``weight_block_size: [128, 128]`` (as Qwen3-30B-A3B-FP8) the e4m3 weights, each
128 x 128 block's ``weight_scale_inv`` given to the block's rows, so that scales are ``[experts,
rows, groups of 128 input features]`` and split and route with their rows (``down_proj``'s
groups split across ranks with its columns: each rank's share of the intermediate size must
then be a multiple of 128)."""

import torch
import triton
from torch import nn

from nanovllm.kernels.fp8 import FP8, GROUP
from nanovllm.kernels.fused_moe import fused_moe, fused_moe_ref
from nanovllm.layers.fp8 import block_scales_per_row, quantize_weight, quantize_weight_blocks
from nanovllm.layers.parallel import TPGroup, copy_weight, divide, shard_of


def quantize_rows(loaded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[..., rows, in]`` weight as ``(e4m3 weight, scale [..., rows])``, each row scaled over
    its whole length (a meta tensor gives meta outputs: a dry run's shapes)."""
    weight, scale = quantize_weight(loaded.reshape(-1, loaded.shape[-1]))
    return weight.view(loaded.shape), scale.view(loaded.shape[:-1])


def _check_dims(loaded: torch.Tensor, expert: int | None) -> None:
    """One expert's tensor is 2-d, every expert's at once (``expert`` None) 3-d."""
    if loaded.dim() != (3 if expert is None else 2):
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {3 if expert is None else 2} dimensions")


def quantize_blocks(loaded: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A model-dtype ``[rows, in]`` (or stacked ``[experts, rows, in]``) weight as an FP8
    checkpoint would hold it, each of its ``parts`` (gate and up: 2) quantized by 128 x 128
    blocks: ``(e4m3 weight, block scales per row [..., rows, groups])``."""
    if loaded.dim() == 3:
        pairs = [quantize_blocks(expert, parts) for expert in loaded]
        return torch.stack([w for w, _ in pairs]), torch.stack([s for _, s in pairs])
    pairs = [quantize_weight_blocks(part) for part in loaded.chunk(parts, dim=0)]
    weights = [w for w, _ in pairs]
    scales = [block_scales_per_row(s, w.shape[0]) for w, s in pairs]
    return torch.cat(weights), torch.cat(scales)


class FusedMoE(nn.Module):
    """``w13`` ``[experts, 2 * intermediate / tp, hidden]`` (gate rows, then up rows) and ``w2``
    ``[experts, hidden, intermediate / tp]``, loaded from each expert's Hugging Face
    ``gate_proj`` / ``up_proj`` / ``down_proj`` (or transformers' stacked ``gate_up_proj`` /
    ``down_proj``). ``quant="fp8"``: both in e4m3, with ``w13_scale [experts, 2 * intermediate /
    tp]`` and ``w2_scale [experts, hidden]`` (float32), written by the weights' loader;
    ``"fp8_tensor"``: the same layout, an FP8 checkpoint's e4m3 weights as stored and each
    tensor's ``weight_scale`` given to its rows; ``"fp8_block"``: both in e4m3 as an FP8
    checkpoint stores them, ``w13_scale [experts, 2 * intermediate / tp, ceil(hidden / 128)]``
    and ``w2_scale [experts, hidden, intermediate / tp / 128]`` from its ``weight_scale_inv``
    tensors; ``None``: the model dtype."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TPGroup,
        quant: str | None = None,
    ):
        super().__init__()
        if quant not in (None, "fp8", "fp8_tensor", "fp8_block"):
            raise ValueError(
                "mixture-of-experts weights can be held as None, 'fp8', 'fp8_tensor' or 'fp8_block', "
                f"not {quant!r}"
            )
        self.tp = tp
        inter = divide(intermediate_size, tp.size)
        if quant == "fp8_block" and tp.size > 1 and inter % GROUP:  # (Config says so first)
            raise ValueError(f"block-scaled experts split into {inter} rows a rank, not whole blocks")
        dtype = FP8 if quant else None
        w13 = torch.empty(num_experts, 2 * inter, hidden_size, dtype=dtype)
        w2 = torch.empty(num_experts, hidden_size, inter, dtype=dtype)
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        if quant in ("fp8", "fp8_tensor"):
            scale13 = torch.ones(num_experts, 2 * inter, dtype=torch.float32)
            scale2 = torch.ones(num_experts, hidden_size, dtype=torch.float32)
            self.w13_scale = nn.Parameter(scale13, requires_grad=False)
            self.w2_scale = nn.Parameter(scale2, requires_grad=False)
        if quant == "fp8":
            # written with the weights: no checkpoint tensor of their own
            self.w13_scale.derived = self.w2_scale.derived = True
            self.w13.weight_loader = self.w2.weight_loader = self.fp8_weight_loader
        elif quant == "fp8_tensor":  # an FP8 checkpoint's per-tensor scales, kept per row
            self.w13.weight_loader = self.w2.weight_loader = self.fp8_tensor_weight_loader
            self.w13_scale.weight_loader = self.w2_scale.weight_loader = self.fp8_tensor_scale_loader
        elif quant == "fp8_block":
            groups13, groups2 = triton.cdiv(hidden_size, GROUP), triton.cdiv(inter, GROUP)
            scale13 = torch.ones(num_experts, 2 * inter, groups13, dtype=torch.float32)
            scale2 = torch.ones(num_experts, hidden_size, groups2, dtype=torch.float32)
            self.w13_scale = nn.Parameter(scale13, requires_grad=False)
            self.w2_scale = nn.Parameter(scale2, requires_grad=False)
            self.w13.weight_loader = self.w2.weight_loader = self.fp8_block_weight_loader
            self.w13_scale.weight_loader = self.w2_scale.weight_loader = self.fp8_block_scale_loader
        else:
            self.w13.weight_loader = self.w2.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int | None, int | None]
    ) -> None:
        """``shard_id``: (expert, 0 for gate / 1 for up / None for down); expert None: every
        expert at once, as transformers keeps them in memory (``gate_up_proj`` ``[experts,
        2 * intermediate, hidden]``, gate rows first; ``down_proj`` ``[experts, hidden,
        intermediate]``)."""
        self._route(param.data, loaded, shard_id, split_columns=True)

    def fp8_weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int | None, int | None]
    ) -> None:
        """As :meth:`weight_loader`, for e4m3 weights: ``loaded`` (16/32-bit, or e4m3 values taken
        as numbers) is quantized per row over its whole length, then its e4m3 rows and their scales
        go where the model-dtype weight's rows would. A loader's dry run (a meta ``param``) writes
        no scale either."""
        expert, half = shard_id
        _check_dims(loaded, expert)
        # quantized where the parameter lives (on the GPU, not the host's cores), as linear layers do
        weight, scale = quantize_rows(loaded if param.is_meta else loaded.to(param.device))
        scales = self.w2_scale if half is None else self.w13_scale
        if param.is_meta:
            scales = torch.empty_like(scales, device="meta")
        self._route(param.data, weight, shard_id, split_columns=True)
        # a scale belongs to a whole row: w13's are split with their rows, w2's not at all
        self._route(scales.data, scale, shard_id, split_columns=False)

    def fp8_tensor_weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int | None, int | None]
    ) -> None:
        """An FP8 checkpoint's e4m3 expert weight as stored (its scale comes as its own tensor); a
        model-dtype one (a weight update) quantized per row as ``quantization="fp8"`` does."""
        if loaded.dtype != FP8:
            self.fp8_weight_loader(param, loaded, shard_id)
            return
        _check_dims(loaded, shard_id[0])
        self._route(param.data, loaded, shard_id, split_columns=True)

    def fp8_tensor_scale_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int | None, int | None]
    ) -> None:
        """A checkpoint's one ``weight_scale`` for one expert's gate, up or down projection,
        given to each of its rows."""
        expert, half = shard_id
        if expert is None or loaded.numel() != 1:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected one scale for one expert's tensor")
        rows = self._checkpoint_rows(half)
        self._route(param.data, loaded.float().reshape(1).expand(rows), shard_id, split_columns=False)

    def fp8_block_weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int | None, int | None]
    ) -> None:
        """An FP8 checkpoint's e4m3 expert weight as stored (its scales come as their own
        tensors); a model-dtype one (a weight update) quantized by 128 x 128 blocks as the
        checkpoint would hold it, its scales written with it."""
        expert, half = shard_id
        _check_dims(loaded, expert)
        if loaded.dtype != FP8:
            # stacked gate_up holds gate's rows then up's, each blocked on its own in a checkpoint
            parts = 2 if expert is None and half is not None else 1
            if param.is_meta:
                loaded = loaded.to(FP8)
            else:
                loaded, scales = quantize_blocks(loaded.to(param.device), parts)
                self._route_scales(scales, shard_id)
        self._route(param.data, loaded, shard_id, split_columns=True)

    def fp8_block_scale_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int | None, int | None]
    ) -> None:
        """A checkpoint's ``weight_scale_inv`` of one expert's gate, up or down projection
        (``[ceil(rows / 128), ceil(in / 128)]``), each block's scale given to its rows."""
        expert, half = shard_id
        if expert is None or loaded.dim() != 2:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected one expert's 2-d block scales")
        rows = self._checkpoint_rows(half)
        if loaded.shape[0] != triton.cdiv(rows, GROUP):
            raise ValueError(
                f"has shape {tuple(loaded.shape)}, expected {triton.cdiv(rows, GROUP)} blocks of "
                f"{GROUP} rows for {rows} rows"
            )
        self._route_scales(block_scales_per_row(loaded, rows), shard_id, param)

    def _checkpoint_rows(self, half: int | None) -> int:
        """Rows of one expert's ``down_proj`` (``half`` None) or ``gate_proj`` / ``up_proj`` in
        the checkpoint, before any tensor-parallel split."""
        return self.w2.shape[1] if half is None else self.w13.shape[1] // 2 * self.tp.size

    def _route_scales(
        self, scales: torch.Tensor, shard_id: tuple[int | None, int | None], param: nn.Parameter | None = None
    ) -> None:
        """Block scales per row go where their rows go: gate / up's rows split across ranks,
        down's groups of input features with its columns."""
        param = param if param is not None else self.w2_scale if shard_id[1] is None else self.w13_scale
        self._route(param.data, scales, shard_id, split_columns=shard_id[1] is None)

    def _route(
        self,
        dst: torch.Tensor,
        loaded: torch.Tensor,
        shard_id: tuple[int | None, int | None],
        split_columns: bool,
    ) -> None:
        """Copy this rank's part of the whole checkpoint tensor ``loaded`` into ``dst`` (``w13`` /
        ``w2`` or their scales, which lack the last dimension). ``split_columns``: ``w2``'s last
        dimension is this rank's slice of the intermediate size (false for its scales)."""
        expert, half = shard_id
        dst = dst if expert is None else dst[expert]
        if half is None:  # down_proj
            if split_columns:
                loaded = shard_of(loaded, dst.dim() - 1, self.tp, dst.shape[-1])
            copy_weight(dst, loaded)
            return
        row_dim = 1 if expert is None else 0  # gate / up rows, split across ranks
        inter = dst.shape[row_dim] // 2
        if expert is None:  # gate rows then up rows, each split across ranks
            if loaded.dim() <= row_dim or loaded.shape[row_dim] != 2 * inter * self.tp.size:
                raise ValueError(
                    f"has shape {tuple(loaded.shape)}, expected {2 * inter * self.tp.size} along "
                    f"dimension {row_dim}"
                )
            parts = list(enumerate(loaded.chunk(2, dim=row_dim)))
        else:
            parts = [(half, loaded)]
        for part, rows in parts:
            copy_weight(dst.narrow(row_dim, part * inter, inter), shard_of(rows, row_dim, self.tp, inter))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        moe = fused_moe if x.is_cuda else fused_moe_ref
        scales = {}
        if self.w13.dtype == FP8:
            scales = dict(w13_scale=self.w13_scale, w2_scale=self.w2_scale)
        return self.tp.all_reduce(moe(x, self.w13, self.w2, topk_weights, topk_ids, **scales))
