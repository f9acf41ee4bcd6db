"""Decode attention with the q/k prologue in the same kernel against its reference: the fused
q/k norm + rotary + KV store, then decode attention (interpreter on CPU)."""

import pytest
import torch

from nanovllm.kernels import decode_attention as dec
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from tests.interpreter import DEVICE
from tests.kernels.test_attention_kernels import check, make_cache

pytestmark = pytest.mark.gpu

HEADS, HEAD_DIM, BLOCK = 8, 64, 16


def decode_step(lens: list[int], kv_heads: int, dtype, norm: bool, cache_dtype=None, seed=0):
    """A decode step's inputs: raw q, k, v as views of one projection output; each row's new
    token at position ctx - 1, stored in its block; the last row pads a CUDA graph (one key,
    block 0, no store)."""
    k_cache, v_cache, tables, ctx = make_cache(lens, BLOCK, kv_heads, HEAD_DIM, dtype, "garbage", seed)
    if cache_dtype is not None:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    rows = len(lens) + 1
    qkv = torch.randn(rows, (HEADS + 2 * kv_heads) * HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([HEADS * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], dim=-1)
    q, k, v = (
        q.view(rows, HEADS, HEAD_DIM),
        k.view(rows, kv_heads, HEAD_DIM),
        v.view(rows, kv_heads, HEAD_DIM),
    )
    positions = torch.tensor([n - 1 for n in lens] + [0], device=DEVICE)
    slots = [int(tables[b, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for b, n in enumerate(lens)]
    slots = torch.tensor(slots + [-1], device=DEVICE)
    tables = torch.cat([tables, torch.zeros_like(tables[:1])])
    ctx = torch.cat([ctx, torch.ones_like(ctx[:1])])
    weights = [(1 + 0.1 * torch.randn(HEAD_DIM, generator=gen)).to(dtype).to(DEVICE) for _ in range(2)]
    norms = (*weights, 1e-6) if norm else (None, None, 1e-6)
    rope = RotaryEmbedding(HEAD_DIM, 4096, 1e6).cos_sin_cache.to(DEVICE)
    return (q, k, v, positions, rope, *norms, k_cache, v_cache, slots, tables, ctx, HEAD_DIM**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("kv_heads", [2, 8])
def test_prologue_in_decode_matches_the_two_kernels_reference(dtype, norm, num_splits, kv_heads):
    lens = [1, BLOCK, BLOCK + 1, 3 * BLOCK - 5, 70]
    args = decode_step(lens, kv_heads, dtype, norm)
    q, k = args[0].clone(), args[1].clone()
    want_caches = [c.clone() for c in args[8:10]]
    want = dec.paged_decode_attention_with_prologue_ref(*args[:8], *want_caches, *args[10:])
    got = dec.paged_decode_attention_with_prologue(*args, num_splits=num_splits)
    real = len(lens)  # the padding row's output is never read
    check(got[:real], want[:real], dtype)
    for got_cache, want_cache in zip(args[8:10], want_caches):  # the padding row stored nothing
        torch.testing.assert_close(got_cache.float(), want_cache.float(), atol=2e-3, rtol=2e-3)
    assert torch.equal(args[0], q) and torch.equal(args[1], k), "q and k are read, not rewritten"


@pytest.mark.parametrize("num_splits", [1, 4])
def test_prologue_in_decode_in_a_given_row_order(num_splits):
    lens = [5, 70, 33, 1, 48]
    args = decode_step(lens, 2, torch.float32, True, seed=3)
    want_caches = [c.clone() for c in args[8:10]]
    want = dec.paged_decode_attention_with_prologue_ref(*args[:8], *want_caches, *args[10:])
    order = torch.tensor([1, 4, 2, 0, 3, -1], dtype=torch.int32, device=DEVICE)
    got = dec.paged_decode_attention_with_prologue(*args, num_splits=num_splits, row_order=order)
    check(got[: len(lens)], want[: len(lens)], torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter rounds to float8 unlike CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prologue_in_decode_stores_and_reads_a_float8_cache(dtype):
    """The new token's k and v are rounded to e4m3 (saturating) as the store rounds them, and
    attended to at that precision, as the reference reads them back."""
    lens = [1, 17, 40]
    args = decode_step(lens, 2, dtype, True, cache_dtype=torch.float8_e4m3fn, seed=5)
    want_caches = [c.clone() for c in args[8:10]]
    want = dec.paged_decode_attention_with_prologue_ref(*args[:8], *want_caches, *args[10:])
    got = dec.paged_decode_attention_with_prologue(*args, num_splits=2)
    # a k one fp32 bit apart may round to float8 apart (an eighth): scores move a little
    torch.testing.assert_close(got[: len(lens)], want[: len(lens)], atol=2e-2, rtol=2e-2)
    (k_cache, v_cache), (want_k, want_v) = args[8:10], want_caches
    torch.testing.assert_close(k_cache.float(), want_k.float(), atol=2**-9, rtol=0.125)
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="bf16 needs CUDA (the interpreter's bf16 dot is wrong)"
)
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_prologue_in_decode_bf16_long_contexts(num_splits):
    lens = [3000, 1, 777, 64, 2049]
    args = decode_step(lens, 2, torch.bfloat16, True, seed=7)
    want_caches = [c.clone() for c in args[8:10]]
    want = dec.paged_decode_attention_with_prologue_ref(*args[:8], *want_caches, *args[10:])
    got = dec.paged_decode_attention_with_prologue(*args, num_splits=num_splits)
    torch.testing.assert_close(got[: len(lens)].float(), want[: len(lens)].float(), atol=2e-2, rtol=2e-2)
    for got_cache, want_cache in zip(args[8:10], want_caches):
        torch.testing.assert_close(got_cache, want_cache, atol=2e-2, rtol=2e-2)
