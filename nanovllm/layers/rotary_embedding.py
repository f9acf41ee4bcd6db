"""Rotary position embedding tables (rotate-half / GPT-NeoX layout), with the rope scaling
types Hugging Face defines: those that fix the table once, and "dynamic" (NTK-aware), whose
frequencies follow the sequence length. The attention backend applies them, fused with the
KV store."""

import math

import torch
from torch import nn

from nanovllm.layers.rope_scaling import SCALING_TYPES, dynamic_factor, scaling_type


def _dynamic_base(
    base: float, factor: float, context: int, head_dim: int, seq_len: int | torch.Tensor
) -> float | torch.Tensor:
    """Dynamic NTK: the base for a sequence of ``seq_len`` >= ``context`` tokens, in Hugging
    Face's order of operations: an int (Python floats, as at its init) or a tensor (fp32, as
    in its forward)."""
    return base * ((factor * seq_len / context) - (factor - 1)) ** (head_dim / (head_dim - 2))


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
    (a type of :data:`SCALING_TYPES`, as Hugging Face's ``rope_parameters`` spell it), where
    ``max_position`` is the checkpoint's ``max_position_embeddings``."""
    rope_type = scaling_type(scaling)
    if rope_type == "yarn":
        return _yarn(head_dim, base, scaling, max_position)
    inv_freq = _default_inv_freq(head_dim, base)
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "dynamic":  # for sequences up to ``max_position`` long
        base = _dynamic_base(base, dynamic_factor(scaling), max_position, head_dim, max_position)
        return _default_inv_freq(head_dim, base), 1.0
    if rope_type != "default":
        raise ValueError(f"rope scaling type {rope_type!r} is not implemented; implemented: {SCALING_TYPES}")
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """``cos_sin_cache[position]``: the cos then the sin of every frequency, fp32, for
    ``max_position`` positions. ``max_position_embeddings`` (default ``max_position``) is the
    length that yarn and dynamic scaling scale from.

    Dynamic scaling (``is_dynamic``) rotates a token by the length of its sequence: the table
    serves sequences up to ``max_position_embeddings`` long, :meth:`cos_sin_rows` any length.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict | None = None,
        max_position_embeddings: int | None = None,
    ):
        super().__init__()
        scaling = scaling or {}
        self.context = max_position_embeddings or max_position
        inv_freq, factor = inv_freq_and_attention_factor(head_dim, base, scaling, self.context)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * factor
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.is_dynamic = scaling_type(scaling) == "dynamic"
        if self.is_dynamic:
            self.base, self.factor, self.head_dim = base, dynamic_factor(scaling), head_dim
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            self.register_buffer("exponents", exponents, persistent=False)

    def cos_sin_rows(self, positions: torch.Tensor, rope_lengths: torch.Tensor) -> torch.Tensor:
        """``[tokens, head_dim]`` in the table's layout: token ``i`` at ``positions[i]`` in a
        sequence of ``rope_lengths[i]`` tokens (dynamic scaling). Tensor ops only: no host
        sync, so CUDA graphs can capture it."""
        lengths = rope_lengths.clamp(min=self.context)[:, None]
        base = _dynamic_base(self.base, self.factor, self.context, self.head_dim, lengths.float())
        freqs = positions[:, None].float() * (1.0 / base**self.exponents)
        rows = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        # up to the original length, Hugging Face keeps the frequencies of its init: the table's
        return torch.where(lengths > self.context, rows, self.cos_sin_cache[positions])
