"""Long prompts with no cached prefix through cuDNN's fused attention (torch's SDPA).

On Hopper, cuDNN's causal kernel runs an 8,192-token prompt of the 8B's heads 1.3x faster
than our paged Triton kernel (558 against 423 TFLOP/s on an H100; `benchmarks/MEASUREMENTS.md`),
reading K/V from the step itself rather than the cache. It takes one dense sequence a call, so
it serves steps whose prompts are all long: a few launches a layer, each near its peak.

Off by default (``NANOVLLM_CUDNN_PREFILL=1`` in the environment turns it on): it takes 12.5 ms
off the 8B's 8k-token first token on an H200, but cuDNN builds a plan for every prompt length
on its first call at that length, ~47 ms, so a prompt of a length not seen before is slower
than through the paged kernel. Lengths rounded up to a few buckets, whose plans are built at
start-up, would remove that cost.
"""

import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MIN_PROMPT_TOKENS = 2048
"""The shortest prompt worth a launch of its own (measured faster from 2,048 tokens)."""

ENABLED = os.environ.get("NANOVLLM_CUDNN_PREFILL", "0") == "1"


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


def cudnn_causal_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens_q: tuple[int, ...], scale: float
) -> torch.Tensor:
    """Causal attention of each prompt over itself. q: ``[tokens, heads, head_dim]``; k, v:
    ``[tokens, kv_heads, head_dim]``; prompts packed back to back, ``seqlens_q`` tokens each.
    Returns ``[tokens, heads, head_dim]``, contiguous."""
    out = None if len(seqlens_q) == 1 else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    start = 0
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for length in seqlens_q:
            end = start + length
            # [1, heads, tokens, head_dim] views of the token-major rows: no copy in
            qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            attended = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
            )
            rows = attended[0].transpose(0, 1)
            if out is None:
                return rows.contiguous()
            out[start:end] = rows
            start = end
    return out
