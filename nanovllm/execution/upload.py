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


def upload(device: torch.device, *groups, into: torch.Tensor | None = None) -> None:
    """Replace, in place, each numpy-array field of the dataclass instances ``groups`` with a
    device tensor of the same values (fields that are None or anything else stay as they are).

    Arrays are packed into one buffer in field order, ``groups`` in order, from offset 0, each
    view 16-byte aligned: Triton specialises kernels on pointer alignment, so views at varying
    alignments would compile a kernel again mid-run.

    ``into`` (uint8, on ``device``) is the buffer to fill instead of a new one: the first group's
    arrays always go there, so a step whose first group has the same fields and shapes as an
    earlier one's finds them at the same addresses (what a CUDA graph reads); the other groups
    follow them there when everything fits, else they go to a new buffer (a second transfer).
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
    starts, total, first_group_bytes = [], 0, 0
    for group, _, a in arrays:
        starts.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
        if group is groups[0]:
            first_group_bytes = total
    flat = np.zeros(total, dtype=np.uint8)
    for start, (_, _, a) in zip(starts, arrays):
        flat[start : start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        host = host.pin_memory()
    if into is None:
        targets = [(0, host.to(device, non_blocking=True))]
    elif total <= into.numel():
        targets = [(0, into[:total].copy_(host, non_blocking=True))]
    elif first_group_bytes <= into.numel():
        lead, rest = host[:first_group_bytes], host[first_group_bytes:]
        targets = [
            (0, into[:first_group_bytes].copy_(lead, non_blocking=True)),
            (first_group_bytes, rest.to(device, non_blocking=True)),
        ]
    else:
        raise ValueError(f"the first group's arrays take {first_group_bytes} bytes, `into` {into.numel()}")
    for start, (group, name, a) in zip(starts, arrays):
        begin, buffer = [(b, t) for b, t in targets if b <= start][-1]
        view = buffer[start - begin : start - begin + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
        setattr(group, name, view)
