"""Long prompts with no cached prefix through cuDNN's fused attention (torch's SDPA).

On Hopper, cuDNN's causal kernel runs an 8,192-token prompt of the 8B's heads 1.3x faster
than our paged Triton kernel (558 against 423 TFLOP/s on an H100; `benchmarks/MEASUREMENTS.md`),
reading K/V from the step itself rather than the cache. It takes one dense sequence a call, so
it serves steps whose prompts are all long: a few launches a layer, each near its peak.

cuDNN builds a plan for every prompt length on its first call at that length (~45 ms, more
than a prompt gains), so prompts are padded at their end to one of a few bucket lengths
(:func:`bucket_length`), whose plans the engine builds at start-up (:func:`build_plans`, 25 for
a 16k-token budget, ~1 s). On by default: -10 to -12 ms on the 8B's 8k-token first token on an
H100; ``NANOVLLM_CUDNN_PREFILL=0`` in the environment keeps the paged kernel, to measure it.
"""

import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MIN_PROMPT_TOKENS = 2048
"""The shortest prompt worth a launch of its own (measured faster from 2,048 tokens)."""

ENABLED = os.environ.get("NANOVLLM_CUDNN_PREFILL", "1") != "0"
_BACKENDS = [SDPBackend.CUDNN_ATTENTION]  # (the tests run the padding on CPU through MATH)


def cudnn_prefill_supported(device: torch.device) -> bool:
    """Whether :func:`cudnn_causal_prefill` runs on ``device``: CUDA with cuDNN, compute
    capability 9.0 or newer (where its fused attention was measured)."""
    return (
        device.type == "cuda"
        and torch.backends.cudnn.is_available()
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


def takes_prompts(seqlens_q: tuple[int, ...], dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether prompts of these query lengths (and no cached prefix) go to cuDNN: in 16 bits,
    over a cache that holds K/V as the step computed them (an 8-bit cache's prompts attend to
    the rounded K/V they will find there later, through the paged kernel)."""
    half = dtype in (torch.bfloat16, torch.float16) and cache_dtype == dtype
    return half and bool(seqlens_q) and min(seqlens_q) >= MIN_PROMPT_TOKENS


BUCKETS_PER_OCTAVE = 8
"""Prompt lengths are rounded up to one of this many lengths an octave (padding under 1/8):
cuDNN builds a plan for each length it meets (~47 ms on an H200), so the engine builds one a
bucket at start-up (:func:`build_plans`) and none after."""


def bucket_length(tokens: int) -> int:
    """``tokens`` rounded up to its bucket."""
    step = 1 << max(tokens.bit_length() - 1 - (BUCKETS_PER_OCTAVE.bit_length() - 1), 0)
    return -(-tokens // step) * step


def bucket_lengths(max_tokens: int) -> list[int]:
    """Every bucket from :data:`MIN_PROMPT_TOKENS` up to the one ``max_tokens`` falls in."""
    buckets, top = [], bucket_length(max_tokens)
    length = bucket_length(MIN_PROMPT_TOKENS)
    while length <= top:
        buckets.append(length)
        length = bucket_length(length + 1)
    return buckets


def cudnn_causal_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens_q: tuple[int, ...], scale: float
) -> torch.Tensor:
    """Causal attention of each prompt over itself. q: ``[tokens, heads, head_dim]``; k, v:
    ``[tokens, kv_heads, head_dim]``, as views of one ``[tokens, heads + 2 * kv_heads,
    head_dim]`` projection; prompts packed back to back, ``seqlens_q`` tokens each. Returns
    ``[tokens, heads, head_dim]``, contiguous. A prompt whose length is not a bucket's is padded
    to it at its end (its rows attend to no padding under the causal mask)."""
    out = None if len(seqlens_q) == 1 else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    start = 0
    for length in seqlens_q:
        end = start + length
        padded = bucket_length(length)
        if padded == length:  # views of the step's rows: no copy in
            rows = _attend(q[start:end], k[start:end], v[start:end], scale)
        else:
            qp, kp, vp = _packed(padded, q.shape[1], k.shape[1], q.shape[2], q.dtype, q.device)
            qp[:length], kp[:length], vp[:length] = q[start:end], k[start:end], v[start:end]
            kp[length:], vp[length:] = 0, 0
            rows = _attend(qp, kp, vp, scale)[:length]
        if out is None:
            return rows.contiguous()
        out[start:end] = rows
        start = end
    return out


def build_plans(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    dtype: torch.dtype,
    device,
    max_tokens: int,
) -> int:
    """Has cuDNN build its plan for every bucket up to ``max_tokens`` (a layer's heads, q/k/v
    laid out as the engine passes them); returns how many."""
    buckets = bucket_lengths(max_tokens)
    for length in buckets:
        _attend(*_packed(length, num_heads, num_kv_heads, head_dim, dtype, device), scale)
    return len(buckets)


def _packed(tokens, num_heads, num_kv_heads, head_dim, dtype, device) -> tuple[torch.Tensor, ...]:
    """q, k, v as views of one new, uninitialised ``[tokens, heads + 2 * kv_heads, head_dim]``
    tensor, so their strides are the engine's (the plan cache keys on strides too)."""
    qkv = torch.empty(tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    return tuple(qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One prompt's causal attention, token-major in and out (``[tokens, heads, head_dim]``)."""
    # [1, heads, tokens, head_dim] views of the token-major rows
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    with sdpa_kernel(_BACKENDS):
        attended = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    return attended[0].transpose(0, 1)
