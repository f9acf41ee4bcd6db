"""What the kernels ask of the device they launch on, read once per device: its SM count,
compute capability, whether kernels launch as programmatic dependents, and whether the weight
prefetch rides on that (:func:`weight_prefetch`)."""

import functools
import os

import torch
import triton
import triton.language as tl

_PDL_AVAILABLE = hasattr(tl.extra.cuda, "gdc_wait") and os.environ.get("NANOVLLM_PDL", "1") != "0"
_WEIGHT_PREFETCH = (
    hasattr(tl.extra.cuda, "gdc_launch_dependents") and os.environ.get("NANOVLLM_WEIGHT_PREFETCH", "0") == "1"
)

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


def weight_prefetch(device: torch.device) -> bool:
    """Whether, on ``device``, kernels that a weight-bound GEMM follows let it launch while they
    run (:func:`release_dependents`) and the GEMM asks L2 for its first weight bytes before it
    waits for them (:func:`prefetch_l2`): the weights do not depend on the kernel before, so
    their read overlaps it. Off unless ``NANOVLLM_WEIGHT_PREFETCH=1``; needs programmatic
    dependent launch (:func:`pdl_options`)."""
    return _WEIGHT_PREFETCH and pdl_options(device)["PDL"]


@triton.jit
def release_dependents(RELEASE: tl.constexpr):
    """After :func:`wait_for_prior_grid`: let the next kernel's grid launch now rather than when
    this one ends. It still waits for this kernel's results at its own wait; what it does before
    that (:func:`prefetch_l2`) overlaps this kernel."""
    if RELEASE:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask):
    """Ask L2 for the cache lines holding ``ptrs`` (where ``mask``), without waiting for them
    or using registers for their data (CUDA only: PTX)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
