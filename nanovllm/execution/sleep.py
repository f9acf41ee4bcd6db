"""Sleep mode on one rank: a model's weights out of device memory, and back."""

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class _View:
    """A parameter or buffer as a view of its storage, to be bound again to a new one."""

    tensor: torch.Tensor
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]


@dataclass
class _Storage:
    """One device storage of the model's weights and the views into it; ``host`` holds its
    bytes (pinned where the device is a GPU) when they are to come back."""

    nbytes: int
    views: list[_View] = field(default_factory=list)
    host: torch.Tensor | None = None


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class OffloadedWeights:
    """The parameters and buffers of ``model`` with their device memory freed.

    Each storage is handled once, whatever shares it (a tied LM head is its embedding's
    Parameter), and the Parameter and buffer objects stay, each holding an empty tensor, so
    that whatever refers to them (modules, weight loaders, compiled functions) sees them again
    after :meth:`restore`, bound to new memory with their shapes, strides and sharing.

    Buffers (rotary tables: no checkpoint holds them) are always copied to CPU memory first;
    parameters only with ``keep_parameters``, else their values are lost and the caller loads
    them again after :meth:`restore`.
    """

    def __init__(self, model: nn.Module, device: torch.device, keep_parameters: bool):
        self.device = device
        self.storages: dict[int, _Storage] = {}
        kept: set[int] = set()
        tensors = [(p, keep_parameters) for p in model.parameters()] + [(b, True) for b in model.buffers()]
        for tensor, keep in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                continue
            key = storage.data_ptr()
            entry = self.storages.setdefault(key, _Storage(storage.nbytes()))
            entry.views.append(_View(tensor, tensor.storage_offset(), tensor.shape, tensor.stride()))
            if keep:
                kept.add(key)
        pin = device.type == "cuda"
        for key, entry in self.storages.items():
            if key in kept:
                entry.host = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=pin)
                entry.host.copy_(_as_bytes(entry.views[0].tensor.untyped_storage()), non_blocking=pin)
        if pin:
            torch.cuda.synchronize(device)
        with torch.no_grad():
            for entry in self.storages.values():
                for view in entry.views:
                    view.tensor.data = torch.empty(0, dtype=view.tensor.dtype, device=device)

    @property
    def nbytes(self) -> int:
        """Device bytes freed."""
        return sum(entry.nbytes for entry in self.storages.values())

    def restore(self) -> None:
        """Allocate every storage again, copy back the bytes kept, and bind the views to it.
        May be called again after a failure (say, out of memory) part way."""
        with torch.no_grad():
            for entry in self.storages.values():
                memory = torch.empty(entry.nbytes, dtype=torch.uint8, device=self.device)
                if entry.host is not None:
                    memory.copy_(entry.host, non_blocking=True)
                storage = memory.untyped_storage()
                for view in entry.views:
                    blank = torch.empty(0, dtype=view.tensor.dtype, device=self.device)
                    view.tensor.data = blank.set_(storage, view.offset, view.shape, view.stride)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
