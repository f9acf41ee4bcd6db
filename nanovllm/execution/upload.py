"""A step's many small host arrays moved to the device in one transfer."""

from dataclasses import fields

import numpy as np
import torch

_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
}
_ALIGN = 16  # bytes


def upload(device: torch.device, *groups) -> None:
    """Replace, in place, each numpy-array field of the dataclass instances ``groups`` with a
    device tensor of the same values (fields that are None or anything else stay as they are).

    Arrays are packed into one buffer, 8-byte elements first, then in field order, ``groups`` in
    order; each view starts 16-byte aligned: Triton specialises kernels on pointer alignment, so
    views at varying alignments would compile a kernel again mid-run. The first 8-byte array sits
    at offset 0.
    """
    arrays = [
        (group, f.name, value)
        for group in groups
        for f in fields(group)
        if isinstance(value := getattr(group, f.name), np.ndarray)
    ]
    unsupported = [f"{name} ({a.dtype})" for _, name, a in arrays if a.dtype not in _TORCH_DTYPES]
    if unsupported:
        raise TypeError(f"cannot upload arrays of these dtypes: {unsupported}")
    arrays.sort(key=lambda item: -item[2].dtype.itemsize)  # stable: field order within a size
    starts, total = [], 0
    for _, _, a in arrays:
        starts.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    flat = np.zeros(total, dtype=np.uint8)
    for start, (_, _, a) in zip(starts, arrays):
        flat[start : start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    flat = torch.from_numpy(flat)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    for start, (group, name, a) in zip(starts, arrays):
        view = flat[start : start + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
        setattr(group, name, view)
