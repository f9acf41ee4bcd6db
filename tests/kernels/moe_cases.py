"""Random mixture-of-experts cases shared by the fused-MoE kernel tests (16-bit and e4m3)."""

import torch

from tests.interpreter import DEVICE


def make_moe(tokens, experts, top_k, hidden, inter, dtype, seed=0, used=None):
    """Random inputs with O(1) outputs; ``used`` restricts the routing to those experts."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    pool = torch.tensor(used if used is not None else range(experts))
    ids = [pool[torch.randperm(len(pool), generator=gen)[:top_k]].tolist() for _ in range(tokens)]
    weights = torch.rand(tokens, top_k, generator=gen)
    ids = torch.tensor(ids, dtype=torch.long).reshape(tokens, top_k)
    return [t.to(dtype).to(DEVICE) for t in (x, w13, w2)] + [weights.to(DEVICE), ids]
