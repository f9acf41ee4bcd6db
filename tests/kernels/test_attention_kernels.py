"""Decode attention, the K/V store and the split reduce: Triton kernels vs their torch references,
and the references vs a naive computation (the prompt kernel: ``test_prefill_attention.py``).

Without CUDA the kernels run through the Triton interpreter on CPU (fp32/fp16 only: the
interpreter gets bf16 ``tl.dot`` wrong); with CUDA the same checks run on the GPU.
"""

import pytest
import torch

from nanovllm.kernels import decode_attention as dec
from nanovllm.kernels import prefill_attention as pre
from nanovllm.kernels.decode_reduce import combine_splits, combine_splits_ref
from nanovllm.kernels.kv_layout import KVLayout
from nanovllm.kernels.qk_norm_rope_store import qk_norm_rope_store, qk_norm_rope_store_ref, store_kvcache_ref
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from tests.interpreter import DEVICE
from tests.kernels.paged_attention_cases import (
    DTYPES,
    LAYOUTS,
    TOL,
    check,
    make_cache,
    make_q,
    naive_attention,
    prefill_inputs,
)

# on a GPU machine these run on the device too (``-m gpu``); on CPU, under the interpreter
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", DTYPES)
@LAYOUTS
def test_store_kvcache_ref(dtype: torch.dtype, layout: KVLayout) -> None:
    num_tokens, num_kv_heads, head_dim, block_size = 11, 2, 64, 16
    qkv = make_q(num_tokens, 4, num_kv_heads, head_dim, dtype)._base
    key, value = qkv[:, 4:6], qkv[:, 6:8]  # strided views, as split from a fused qkv
    slots = torch.randperm(5 * block_size)[:num_tokens].int()
    slots[[2, 7]] = -1
    k_cache = torch.randn(5, block_size, num_kv_heads, head_dim).to(dtype).to(DEVICE)
    v_cache = k_cache + 1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected_k.view(-1, num_kv_heads, head_dim)[s] = key[t]
            expected_v.view(-1, num_kv_heads, head_dim)[s] = value[t]
    slots = slots.to(DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_v = layout.v_view(torch.empty_like(ref_v)).copy_(ref_v)
    store_kvcache_ref(key, value, ref_k, ref_v, slots, layout=layout)
    assert torch.equal(ref_k, expected_k) and torch.equal(ref_v, expected_v)


# (block_size, num_kv_heads, head_dim, num_splits, pad); num_heads is always 8.
DECODE_CASES = [
    (16, 8, 64, 1, "neg"),
    (16, 2, 64, None, "garbage"),
    (32, 4, 64, 3, "neg"),
    (32, 1, 64, None, "neg"),
    (64, 2, 128, 1, "garbage"),
    (64, 1, 64, 5, "garbage"),
    (16, 4, 64, 16, "neg"),  # more splits than some sequences have tiles
]


@LAYOUTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim,num_splits,pad", DECODE_CASES)
def test_decode_attention(block_size, num_kv_heads, head_dim, num_splits, pad, dtype, layout) -> None:
    lens = [1, block_size, block_size + 1, 3 * block_size - 5, 4 * block_size]
    if block_size == 64:
        lens = [1, 65, 130, 7]
    k_cache, v_cache, tables, ctx = make_cache(
        lens, block_size, num_kv_heads, head_dim, dtype, pad, layout=layout
    )
    q = make_q(len(lens), 8, num_kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    out = dec.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale, num_splits, layout=layout)
    check(out, dec.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, scale), dtype)


def test_decode_attention_combines_many_splits() -> None:
    """80 splits of a 1,100-token context, 69 of them holding tokens: the reduce takes them in
    more than one pass."""
    k_cache, v_cache, tables, ctx = make_cache([1100, 40], 16, 1, 32, torch.float32, "neg")
    q = make_q(2, 2, 1, 32, torch.float32)
    out = dec.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2, 80)
    check(out, dec.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.2), torch.float32)


@LAYOUTS
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_in_a_given_row_order(num_splits, layout) -> None:
    """Programs take their rows from ``row_order`` (longest first here; -1 keeps a row in its
    own place): every row still gets its own output."""
    lens = [5, 70, 33, 1, 48, 17]
    k_cache, v_cache, tables, ctx = make_cache(lens, 16, 2, 64, torch.float32, "garbage", layout=layout)
    q = make_q(len(lens), 8, 2, 64, torch.float32)
    # the first four rows longest first, the last two (as a CUDA graph's padding) in place
    order = torch.tensor([1, 2, 0, 3, -1, -1], dtype=torch.int32, device=DEVICE)
    out = dec.paged_decode_attention(
        q, k_cache, v_cache, tables, ctx, 0.2, num_splits, row_order=order, layout=layout
    )
    check(out, dec.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.2), torch.float32)


@pytest.mark.parametrize("pad", ["neg", "garbage"])
def test_decode_ref_vs_naive(pad: str) -> None:
    lens = [1, 16, 17, 45]
    k_cache, v_cache, tables, ctx = make_cache(lens, 16, 2, 64, torch.float32, pad)
    q = make_q(len(lens), 8, 2, 64, torch.float32)
    out = dec.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.2)
    for b, n in enumerate(lens):
        naive = naive_attention(q[b : b + 1], k_cache, v_cache, tables[b], n, 0.2)
        torch.testing.assert_close(out[b : b + 1].double(), naive, atol=1e-5, rtol=1e-5)


def test_default_num_splits() -> None:
    assert dec.default_num_splits(256, 8, 160, 256, 132) == 1
    assert dec.default_num_splits(16, 8, 160, 256, 132) == 5
    assert dec.default_num_splits(1, 8, 160, 256, 132) == 66
    assert dec.default_num_splits(1, 8, 2, 256, 132) == 8  # at least 64 tokens per split
    assert dec.default_num_splits(1, 8, 8, 16, 132) == 2


def test_bad_head_dim() -> None:
    k_cache, v_cache, tables, ctx = make_cache([5], 16, 1, 96, torch.float32)
    q = make_q(1, 2, 1, 96, torch.float32)
    with pytest.raises(ValueError):
        dec.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 1.0)
    with pytest.raises(ValueError):
        cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
        pre.paged_prefill_attention(q, k_cache, v_cache, cu, ctx, tables, 1.0, 1)


@LAYOUTS
@pytest.mark.parametrize("cache", ["same", "float8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("num_splits", [1, 4, 5, 9])
def test_decode_with_its_prologue(num_splits, norm, dtype, cache, layout) -> None:
    """Decode from the projection's raw q/k/v with a ``DecodePrologue`` (inside the split kernel
    from 5 splits, its own kernel first below) equals the prologue then decode, the caches
    included; a padding row (slot -1) stores nothing. The references are the oracle over a
    16-bit cache; over float8 the two kernels are (the interpreter's float8 cast rounds unlike
    torch's; the prologue kernel's own float8 test runs on CUDA)."""
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    lens = [1, 16, 17, 43, 64, 5]
    k_cache, v_cache, tables, ctx = make_cache(lens, block_size, kv_heads, head_dim, dtype, layout=layout)
    if cache == "float8":
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    qkv = make_q(len(lens), heads, kv_heads, head_dim, dtype)._base
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 4000, (len(lens),), generator=gen).to(DEVICE)
    weights = (1 + 0.1 * torch.randn(2, head_dim, generator=gen)).to(dtype).to(DEVICE) if norm else [None] * 2
    last = ctx.long() - 1
    slots = tables.long().gather(1, (last // block_size)[:, None])[:, 0] * block_size + last % block_size
    slots[-1] = -1
    rotary = (positions, RotaryEmbedding(head_dim, 4096, 1e6).cos_sin_cache.to(DEVICE), *weights, 1e-6)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    layout.check(want_v)
    if cache == "same":
        want_q, _ = qk_norm_rope_store_ref(
            q.clone(), k.clone(), v, *rotary, want_k, want_v, slots, layout=layout
        )
        want = dec.paged_decode_attention_ref(want_q, want_k, want_v, tables, ctx, 0.125)
        tol = TOL[dtype]
    else:  # rounded to nearest on both sides; a k that differs in its last bit may round apart
        want_q, _ = qk_norm_rope_store(q.clone(), k.clone(), v, *rotary, want_k, want_v, slots, layout=layout)
        want = dec.paged_decode_attention(want_q, want_k, want_v, tables, ctx, 0.125, layout=layout)
        tol = 0.125
    got = dec.paged_decode_attention(
        q,
        k_cache,
        v_cache,
        tables,
        ctx,
        0.125,
        num_splits,
        layout=layout,
        prologue=dec.DecodePrologue(k, v, *rotary, slots),
    )
    check(got, want, dtype)
    torch.testing.assert_close(k_cache.float(), want_k.float(), atol=TOL[dtype], rtol=tol)
    assert torch.equal(v_cache.float(), want_v.float())  # copied, not computed


@LAYOUTS
@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_float8_cache_is_read_at_scale_1(dtype, num_splits, layout) -> None:
    """Decode and prefill over a float8 (e4m3) cache equal the references, which read it at
    scale 1: the kernels dequantise K/V exactly as the references do."""
    lens = [1, 16, 33, 70]
    k_cache, v_cache, tables, ctx = make_cache(lens, 16, 2, 64, dtype, layout=layout)
    k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    layout.check(v_cache)  # .to() keeps the layout
    q = make_q(len(lens), 8, 2, 64, dtype)
    out = dec.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.125, num_splits, layout=layout)
    check(out, dec.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.125), dtype)
    q_lens = [1, 5, 33, 20]
    q = make_q(sum(q_lens), 8, 2, 64, dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int().to(DEVICE)
    args = (q, k_cache, v_cache, cu, ctx, tables, 0.125)
    out = pre.paged_prefill_attention(*args, max(q_lens), layout=layout)
    check(out, pre.paged_prefill_attention_ref(*args), dtype)


@LAYOUTS
@pytest.mark.parametrize("num_splits", [1, 3])
def test_nan_past_the_context_stays_out(num_splits, layout) -> None:
    """An earlier request left NaN in the slots past each sequence's context: they reach
    neither decode nor prefill. A dim-major V is masked; a token-major V is read whole, so
    there the NaN goes through the store, which keeps it finite."""
    lens = [5, 32, 40, 17]
    k_cache, v_cache, tables, ctx = make_cache(lens, 32, 2, 64, torch.float32, layout=layout)
    live = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=DEVICE)
    for b, n in enumerate(lens):
        for t in range(n):
            live[tables[b, t // 32], t % 32] = True
    dead = (~live).flatten().nonzero().flatten()
    nans = torch.full((dead.numel(), 2, 64), float("nan"), device=DEVICE)
    store_kvcache_ref(nans, nans, k_cache, v_cache, dead, layout=layout)
    assert k_cache[~live].isnan().all()
    assert (v_cache[~live] == 0).all() if layout.v_token_major else v_cache[~live].isnan().all()
    q = make_q(len(lens), 8, 2, 64, torch.float32)
    out = dec.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2, num_splits, layout=layout)
    check(out, dec.paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.2), torch.float32)
    q_lens = [5, 3, 40, 1]
    q = make_q(sum(q_lens), 8, 2, 64, torch.float32)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int().to(DEVICE)
    args = (q, k_cache, v_cache, cu, ctx, tables, 0.2)
    out = pre.paged_prefill_attention(*args, max(q_lens), layout=layout)
    assert not out.isnan().any()
    check(out, pre.paged_prefill_attention_ref(*args), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_store_keeps_a_token_major_v_finite(dtype) -> None:
    """NaN is stored as 0 and infinities as the dtype's largest, into a token-major V only."""
    value = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6, 0.5]).view(5, 1, 1).expand(5, 1, 16)
    k_cache = torch.zeros(1, 16, 1, 16, dtype=dtype)
    layout = KVLayout.V_TOKEN_MAJOR
    v_cache = layout.v_view(torch.zeros_like(k_cache))
    store_kvcache_ref(value, value, k_cache, v_cache, torch.arange(5), layout=layout)
    largest = torch.finfo(dtype).max
    assert v_cache[0, :5, 0, 0].float().tolist() == [0.0, largest, -largest, min(1e6, largest), 0.5]
    assert k_cache[0, 0, 0, 0].float().isnan()  # K is masked where unused: it may keep one


@pytest.mark.parametrize("num_splits", [3, 80])
def test_combine_splits(num_splits) -> None:
    """The reduce weighs each split by its base-2 log-sum-exp; empty splits (-inf) weigh 0."""
    gen = torch.Generator().manual_seed(0)
    part = torch.randn(3, 4, num_splits, 64, generator=gen)
    lse = 4 * torch.randn(3, 4, num_splits, generator=gen)
    lse[:, :, 2:][torch.rand(3, 4, num_splits - 2, generator=gen) < 0.3] = float("-inf")
    part, lse = part.to(DEVICE), lse.to(DEVICE)
    out = torch.empty(3, 4, 64, dtype=torch.float16, device=DEVICE)
    want = torch.empty_like(out)
    combine_splits(part, lse, out)
    combine_splits_ref(part, lse, want)
    check(out, want, torch.float16)


def test_engine_layout_per_dtype() -> None:
    assert KVLayout.for_dtype(torch.float8_e4m3fn) is KVLayout.V_TOKEN_MAJOR
    assert KVLayout.for_dtype(torch.bfloat16) is KVLayout.DIM_MAJOR


@LAYOUTS
def test_kernels_refuse_a_v_cache_in_another_layout(layout) -> None:
    """The kernels read the layout they are given; a V cache laid out otherwise is refused."""
    other = next(other for other in KVLayout if other is not layout)
    q, k_cache, v_cache, cu, ctx, tables = prefill_inputs([3], [2], 16, 2, 64, torch.float32, layout=other)
    with pytest.raises(ValueError, match="laid out"):
        dec.paged_decode_attention(q[:1], k_cache, v_cache, tables, ctx, 0.2, layout=layout)
    with pytest.raises(ValueError, match="laid out"):
        pre.paged_prefill_attention(q, k_cache, v_cache, cu, ctx, tables, 0.2, 2, layout=layout)
