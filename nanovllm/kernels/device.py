"""What the kernels ask of the device they launch on, read once per device: its SM count and
compute capability."""

import functools

import torch

_CPU_SMS = 8  # CPU interpreter: any small number keeps the SM-dependent logic exercised


def _cuda_index(device: torch.device) -> int:
    """The CUDA ordinal ``device`` names (``cuda`` alone: the current device)."""
    return torch.cuda.current_device() if device.index is None else device.index


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; a fixed small count off CUDA."""
    return _cuda_sms(_cuda_index(device)) if device.type == "cuda" else _CPU_SMS


def capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` compute capability of the CUDA device ``device``."""
    if device.type != "cuda":
        raise ValueError(f"{device} has no compute capability: it is not a CUDA device")
    return _cuda_capability(_cuda_index(device))
