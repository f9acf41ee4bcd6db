"""A step's many small host arrays moved to the device in one transfer per element size."""

from dataclasses import fields

import numpy as np
import torch

_CARRIERS = {8: np.dtype(np.int64), 4: np.dtype(np.int32)}
_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
}


def upload(device: torch.device, *groups) -> None:
    """Replace, in place, each numpy-array field of the dataclass instances ``groups`` with a
    device tensor of the same values (fields that are None or anything else stay as they are).

    Arrays are packed in field order, ``groups`` in order; each view starts 16-byte aligned:
    Triton specialises kernels on pointer alignment, so views at varying alignments would
    compile a kernel again mid-run. The first 8-byte array sits at storage offset 0.
    """
    arrays = [
        (group, f.name, value)
        for group in groups
        for f in fields(group)
        if isinstance(value := getattr(group, f.name), np.ndarray)
    ]
    left = [name for _, name, a in arrays if a.dtype.itemsize not in _CARRIERS]
    if left:
        raise TypeError(f"cannot upload arrays of 1- or 2-byte elements: {left}")
    for itemsize, carrier in _CARRIERS.items():
        packed = [(g, name, a) for g, name, a in arrays if a.dtype.itemsize == itemsize]
        if not packed:
            continue
        unit = 16 // itemsize
        starts, total = [], 0
        for _, _, a in packed:
            starts.append(total)
            total += -(-a.size // unit) * unit
        flat = np.zeros(total, dtype=carrier)
        for start, (_, _, a) in zip(starts, packed):
            flat[start : start + a.size] = a.reshape(-1).view(carrier)
        flat = torch.from_numpy(flat)
        if device.type == "cuda":
            flat = flat.pin_memory().to(device, non_blocking=True)
        for start, (group, name, a) in zip(starts, packed):
            view = flat[start : start + a.size].view(a.shape).view(_TORCH_DTYPES[a.dtype])
            setattr(group, name, view)
