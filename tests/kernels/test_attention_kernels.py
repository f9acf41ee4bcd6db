"""Triton kernels vs their torch references, and the references vs a naive computation.

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

# on a GPU machine these run on the device too (``-m gpu``); on CPU, under the interpreter
pytestmark = pytest.mark.gpu

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


# (block_size, num_kv_heads, head_dim, prefixes, q_lens, pad); num_heads is always 8.
PREFILL_CASES = [
    (16, 8, 64, [0, 0, 19, 32, 5], [1, 37, 20, 5, 1], "neg"),
    (16, 2, 64, [0, 3], [70, 1], "garbage"),
    (32, 4, 64, [40, 0, 1], [9, 33, 64], "neg"),
    (32, 1, 128, [0, 50], [25, 14], "garbage"),
    (64, 2, 64, [70, 0], [3, 66], "neg"),
    (128, 2, 64, [200, 0, 64], [60, 130, 1], "garbage"),  # tiles within a block, many unmasked
]


@LAYOUTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim,prefixes,q_lens,pad", PREFILL_CASES)
def test_prefill_attention(block_size, num_kv_heads, head_dim, prefixes, q_lens, pad, dtype, layout):
    args = prefill_inputs(prefixes, q_lens, block_size, num_kv_heads, head_dim, dtype, pad, layout)
    scale = head_dim**-0.5
    out = pre.paged_prefill_attention(*args, scale, max(q_lens), layout=layout)
    check(out, pre.paged_prefill_attention_ref(*args, scale), dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernels_write_into_rows_of_a_given_output(num_splits) -> None:
    """A mixed step's decode rows and prompt rows, each kernel writing its part of one output."""
    prefixes, q_lens = [0, 19], [9, 20]
    q_pre, k_cache, v_cache, cu, ctx, tables = prefill_inputs(prefixes, q_lens, 16, 2, 64, torch.float32)
    lens = [5, 40, 17]
    kd, vd, td, cd = make_cache(lens, 16, 2, 64, torch.float32, seed=3)
    q_dec = make_q(len(lens), 8, 2, 64, torch.float32, seed=4)
    out = torch.full((len(lens) + sum(q_lens) + 1, 8, 64), 7.0, device=DEVICE)  # a row past both
    d = len(lens)
    got_dec = dec.paged_decode_attention(q_dec, kd, vd, td, cd, 0.2, num_splits, out=out[:d])
    got_pre = pre.paged_prefill_attention(q_pre, k_cache, v_cache, cu, ctx, tables, 0.2, 20, out=out[d:-1])
    assert got_dec.data_ptr() == out.data_ptr() and got_pre.data_ptr() == out[d:].data_ptr()
    check(out[:d], dec.paged_decode_attention_ref(q_dec, kd, vd, td, cd, 0.2), torch.float32)
    check(
        out[d:-1],
        pre.paged_prefill_attention_ref(q_pre, k_cache, v_cache, cu, ctx, tables, 0.2),
        torch.float32,
    )
    assert torch.all(out[-1] == 7.0)


def test_kernels_refuse_an_output_unlike_q() -> None:
    k_cache, v_cache, tables, ctx = make_cache([5, 9], 16, 2, 64, torch.float32)
    q = make_q(2, 8, 2, 64, torch.float32)
    for bad in (torch.empty(3, 8, 64), torch.empty(2, 8, 64, dtype=torch.float16), torch.empty(2, 64, 8).mT):
        with pytest.raises(ValueError, match="out must be"):
            dec.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2, out=bad.to(DEVICE))
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="out must be"):
        pre.paged_prefill_attention(
            q, k_cache, v_cache, cu, ctx, tables, 0.2, 1, out=torch.empty(2, 8, 32).to(DEVICE)
        )


def test_prefill_ref_vs_naive() -> None:
    prefixes, q_lens = [0, 19, 3], [1, 20, 30]
    q, k_cache, v_cache, cu, ctx, tables = prefill_inputs(
        prefixes, q_lens, 16, 2, 64, torch.float32, "garbage"
    )
    out = pre.paged_prefill_attention_ref(q, k_cache, v_cache, cu, ctx, tables, 0.2)
    for b in range(len(q_lens)):
        s, e = int(cu[b]), int(cu[b + 1])
        naive = naive_attention(q[s:e], k_cache, v_cache, tables[b], int(ctx[b]), 0.2)
        torch.testing.assert_close(out[s:e].double(), naive, atol=1e-5, rtol=1e-5)


def test_decode_matches_prefill_q_len_1() -> None:
    """Decode is prefill with one new token per sequence."""
    args = prefill_inputs([0, 20, 47], [1, 1, 1], 16, 2, 64, torch.float32)
    q, k_cache, v_cache, _, ctx, tables = args
    out = pre.paged_prefill_attention(*args, 0.2, 1)
    torch.testing.assert_close(out, dec.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2, 2))


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
