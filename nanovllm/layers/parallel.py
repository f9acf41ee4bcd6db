"""The tensor-parallel group a layer shards over, passed explicitly to every layer."""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This process's rank and the group's size; size 1 means no communication."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's last dim on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The least of every rank's ``value``."""
        if self.size == 1:
            return value
        t = torch.tensor([value], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size {denominator}")
    return numerator // denominator


def shard_of(loaded: torch.Tensor, dim: int, tp: TPGroup, size: int) -> torch.Tensor:
    """This rank's ``size`` entries along ``dim`` of a whole checkpoint tensor; ``ValueError``
    unless the tensor holds exactly ``size`` entries per rank there."""
    if loaded.dim() <= dim or loaded.shape[dim] != size * tp.size:
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {size * tp.size} along dimension {dim}")
    return loaded.narrow(dim, tp.rank * size, size)


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` without broadcasting: ``ValueError`` unless the shapes are equal and a
    floating-point parameter gets a floating-point tensor."""
    if src.shape != dst.shape:
        raise ValueError(f"has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    if dst.is_floating_point() and not src.is_floating_point():
        raise ValueError(f"has dtype {src.dtype}, expected a floating-point tensor")
    dst.copy_(src)
