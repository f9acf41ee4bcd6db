"""Rotary position embedding tables (rotate-half / GPT-NeoX layout), with the rope scaling
types Hugging Face defines that fix the table once; the attention backend applies them, fused
with the KV store."""

import math

import torch
from torch import nn

SCALING_TYPES = ("default", "linear", "llama3", "yarn")


def scaling_type(scaling: dict) -> str:
    """The rope scaling type of Hugging Face's ``rope_parameters`` (older configs: ``type``)."""
    return scaling.get("rope_type", scaling.get("type", "default"))


def _default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed down by ``factor``, short ones kept, the band between
    blended linearly in the inverse wavelength."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    slow = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    blend = (context / wavelen - low) / (high - low)
    blended = (1 - blend) * slow / factor + blend * slow
    between = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(between, blended, slow)


def _yarn(head_dim: int, base: float, scaling: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated (divided by ``factor``) low frequencies, extrapolated high ones, a
    linear ramp between the dimensions that turn ``beta_slow`` and ``beta_fast`` times over
    the original context; and a magnitude factor on cos/sin."""
    factor = scaling.get("factor") or max_position / scaling["original_max_position_embeddings"]
    context = scaling["original_max_position_embeddings"]

    def magnitude(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = magnitude(factor, mscale) / magnitude(factor, mscale_all_dim)
        else:
            attention_factor = magnitude(factor)

    def dim_turning(turns: float) -> float:  # the dimension whose wave turns ``turns`` times
        return head_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(scaling.get("beta_fast") or 32), dim_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    extrapolated = _default_inv_freq(head_dim, base)
    inv_freq = extrapolated / factor * ramp + extrapolated * (1 - ramp)
    return inv_freq, float(attention_factor)


def inv_freq_and_attention_factor(
    head_dim: int, base: float, scaling: dict, max_position: int
) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies and the factor on cos/sin for a rope scaling setting
    (a type of :data:`SCALING_TYPES`, as Hugging Face's ``rope_parameters`` spell it)."""
    rope_type = scaling_type(scaling)
    if rope_type == "yarn":
        return _yarn(head_dim, base, scaling, max_position)
    inv_freq = _default_inv_freq(head_dim, base)
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type != "default":
        raise ValueError(f"rope scaling type {rope_type!r} is not implemented; implemented: {SCALING_TYPES}")
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """``cos_sin_cache[position]``: the cos then the sin of every frequency, fp32."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        inv_freq, factor = inv_freq_and_attention_factor(head_dim, base, scaling or {}, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * factor
        self.register_buffer("cos_sin_cache", cache, persistent=False)
