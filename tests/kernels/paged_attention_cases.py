"""Paged KV caches, queries and checks shared by the attention kernels' tests (random blocks,
shuffled, with padding entries past each sequence), and a naive attention to check references."""

import pytest
import torch

from nanovllm.kernels.kv_layout import KVLayout
from tests.interpreter import DEVICE

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-4, torch.float16: 5e-3}
LAYOUTS = pytest.mark.parametrize("layout", list(KVLayout), ids=[layout.value for layout in KVLayout])


def make_cache(
    context_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    pad: str = "neg",
    seed: int = 0,
    layout: KVLayout = KVLayout.DIM_MAJOR,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches in ``layout`` with shuffled blocks; table entries past each sequence's end
    are padding: -1 (``pad="neg"``) or real blocks of other sequences (``pad="garbage"``)."""
    gen = torch.Generator().manual_seed(seed)
    used = [(c + block_size - 1) // block_size for c in context_lens]
    max_blocks = max(used) + 2
    num_blocks = sum(used) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    if pad == "neg":
        tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    else:
        tables = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=gen)
        tables = tables.int()
    start = 0
    for b, n in enumerate(used):
        tables[b, :n] = perm[start : start + n]
        start += n
    lens = torch.tensor(context_lens, dtype=torch.int32)
    v_cache = layout.v_view(torch.empty_like(v_cache)).copy_(v_cache)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE), lens.to(DEVICE)


def make_q(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, seed=1):
    """q as the leading slice of a fused qkv tensor, so it is not contiguous."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    return qkv.to(dtype).to(DEVICE)[:, :num_heads]


def naive_attention(q, k_cache, v_cache, table, ctx, scale):
    """One sequence: gather its K/V token by token, then SDPA with an explicit causal mask.

    q: ``[q_len, num_heads, head_dim]``, the last q_len of the ctx positions.
    """
    block_size = k_cache.shape[1]
    slots = [(int(table[t // block_size]), t % block_size) for t in range(ctx)]
    k = torch.stack([k_cache[b, o] for b, o in slots]).double()  # [ctx, kv_heads, dim]
    v = torch.stack([v_cache[b, o] for b, o in slots]).double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    q_len = q.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.double().transpose(0, 1), k, v, attn_mask=mask.to(q.device), scale=scale
    )
    return o.transpose(0, 1)


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def prefill_inputs(
    prefixes, q_lens, block_size, num_kv_heads, head_dim, dtype, pad="neg", layout=KVLayout.DIM_MAJOR
):
    lens = [p + n for p, n in zip(prefixes, q_lens)]
    k_cache, v_cache, tables, ctx = make_cache(
        lens, block_size, num_kv_heads, head_dim, dtype, pad, layout=layout
    )
    q = make_q(sum(q_lens), 8, num_kv_heads, head_dim, dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int().to(DEVICE)
    return q, k_cache, v_cache, cu, ctx, tables
