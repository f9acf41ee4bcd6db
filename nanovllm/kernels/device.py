"""What the kernels ask of the device they launch on, read once per device: its SM count,
compute capability and whether kernels launch as programmatic dependents."""

import functools
import os

import torch
import triton
import triton.language as tl

_PDL_AVAILABLE = hasattr(tl.extra.cuda, "gdc_wait") and os.environ.get("NANOVLLM_PDL", "1") != "0"

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


def pdl_options(device: torch.device) -> dict[str, bool]:
    """Launch options of a kernel taking a ``PDL`` constexpr: on Hopper and later, launched as a
    programmatic dependent of the kernel before it (its grid scheduled while that one ends), and
    waiting for that kernel's results at its first instruction (:func:`wait_for_prior_grid`)."""
    return _cuda_pdl_options(_cuda_index(device)) if device.type == "cuda" else _NO_PDL


_NO_PDL = {"PDL": False, "launch_pdl": False}


@functools.cache
def _cuda_pdl_options(index: int) -> dict[str, bool]:
    on = _PDL_AVAILABLE and _cuda_capability(index)[0] >= 9
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_prior_grid(PDL: tl.constexpr):
    """First in a kernel launched with :func:`pdl_options`: nothing runs before the kernel ahead
    of it in the stream has finished and its writes are visible (so no read or write races)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
