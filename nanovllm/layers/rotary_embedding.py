"""Rotary position embedding tables (rotate-half / GPT-NeoX layout); the attention backend
applies them, fused with the KV store."""

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """``cos_sin_cache[position]``: the cos then the sin of every frequency, fp32."""

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
