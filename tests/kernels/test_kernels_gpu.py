"""CUDA sweep of the Triton kernels against the torch references (skipped without a GPU)."""

import pytest
import torch

from nanovllm.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from nanovllm.kernels.kv_layout import KVLayout
from nanovllm.kernels.prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from nanovllm.kernels.qk_norm_rope_store import qk_norm_rope_store, qk_norm_rope_store_ref
from nanovllm.kernels.sample import sample_tokens, sample_tokens_ref
from nanovllm.layers.rotary_embedding import RotaryEmbedding

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
Q_GAIN = 3.0  # peaked attention keeps outputs O(1) at long contexts, so errors stay visible


def paged_cache(lens, block_size, num_kv_heads, head_dim, dtype, seed=0, cache_dtype=None):
    """K/V caches holding ``lens`` tokens per sequence in shuffled blocks; -1 padded tables.
    With ``cache_dtype`` (float8), K/V are cast to it and laid out as the engine keeps them
    (:meth:`KVLayout.for_dtype`)."""
    torch.manual_seed(seed)
    used = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(used) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=dtype)
    v_cache = torch.randn(shape, device="cuda", dtype=dtype)
    perm = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    tables = torch.full((len(lens), max(used) + 3), -1, device="cuda", dtype=torch.int32)
    start = 0
    for b, n in enumerate(used):
        tables[b, :n] = perm[start : start + n]
        start += n
    ctx = torch.tensor(lens, device="cuda", dtype=torch.int32)
    if cache_dtype is not None:
        k_cache = k_cache.to(cache_dtype)
        layout = KVLayout.for_dtype(cache_dtype)
        v_cache = layout.v_view(torch.empty_like(v_cache, dtype=cache_dtype)).copy_(v_cache)
    return k_cache, v_cache, tables, ctx


def decode_lens(batch: int, max_ctx: int) -> list[int]:
    lens = torch.randint(1, max_ctx + 1, (batch,)).tolist()
    lens[0] = max_ctx
    if batch > 1:
        lens[-1] = 1
    return lens


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = TOL[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# (batch, max_ctx, block_size, num_heads, num_kv_heads, head_dim)
DECODE_CASES = [
    (1, 32768, 256, 16, 8, 128),
    (1, 32768, 16, 32, 4, 128),
    (7, 32768, 64, 16, 16, 128),
    (7, 3000, 16, 16, 2, 64),
    (64, 8192, 256, 16, 8, 128),
    (64, 4096, 16, 8, 8, 64),
    (256, 2048, 64, 16, 2, 128),
    (256, 1024, 256, 32, 16, 128),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,max_ctx,block_size,num_heads,num_kv_heads,head_dim", DECODE_CASES)
def test_decode(batch, max_ctx, block_size, num_heads, num_kv_heads, head_dim, dtype) -> None:
    lens = decode_lens(batch, max_ctx)
    k_cache, v_cache, tables, ctx = paged_cache(lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(batch, num_heads, head_dim, device="cuda", dtype=dtype) * Q_GAIN
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    check(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, scale))


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
def test_decode_forced_splits(num_splits: int) -> None:
    lens = decode_lens(5, 3000)
    k_cache, v_cache, tables, ctx = paged_cache(lens, 16, 2, 128, torch.bfloat16)
    q = torch.randn(5, 16, 128, device="cuda", dtype=torch.bfloat16) * Q_GAIN
    out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.1, num_splits)
    check(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.1))


@pytest.mark.parametrize("block_size", [128, 16])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (32, 8)])
def test_decode_float8_cache(num_heads, num_kv_heads, num_splits, block_size) -> None:
    """bf16 queries over an e4m3 cache (the path that computes in fp16) match the reference."""
    lens = decode_lens(9, 2000)
    k_cache, v_cache, tables, ctx = paged_cache(
        lens, block_size, num_kv_heads, 128, torch.bfloat16, cache_dtype=torch.float8_e4m3fn
    )
    q = torch.randn(9, num_heads, 128, device="cuda", dtype=torch.bfloat16) * Q_GAIN
    layout = KVLayout.for_dtype(k_cache.dtype)
    out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.1, num_splits, layout=layout)
    check(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.1))


def test_decode_cuda_graph() -> None:
    """Capture once, then replay with other lengths/tables written into the same tensors."""
    max_ctx, block_size = 4096, 64
    k_cache, v_cache, tables, ctx = paged_cache([max_ctx] * 8, block_size, 8, 128, torch.bfloat16)
    q = torch.randn(8, 16, 128, device="cuda", dtype=torch.bfloat16) * Q_GAIN
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles outside the capture
        paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.1)
    for lens in ([max_ctx] * 8, decode_lens(8, max_ctx), [1] * 8):
        ctx.copy_(torch.tensor(lens))
        tables.copy_(tables[torch.randperm(8, device="cuda")])
        q.normal_().mul_(Q_GAIN)
        graph.replay()
        check(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.1))


def test_decode_cache_over_2g_elements() -> None:
    """Cache offsets past 2**31 elements need 64-bit address math."""
    block_size, num_kv_heads, head_dim = 256, 8, 128
    num_blocks = 2**31 // (block_size * num_kv_heads * head_dim) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    k_cache[-8:].normal_()
    v_cache[-8:].normal_()
    tables = torch.arange(num_blocks - 8, num_blocks, device="cuda", dtype=torch.int32)
    tables = tables.view(2, 4)
    ctx = torch.tensor([1000, 777], device="cuda", dtype=torch.int32)
    q = torch.randn(2, 16, head_dim, device="cuda", dtype=torch.bfloat16) * Q_GAIN
    out = paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.1)
    check(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.1))
    # And the store: the last slot of the cache.
    key, value = torch.randn(2, 2, num_kv_heads, head_dim, device="cuda").bfloat16().unbind(1)
    slots = torch.tensor([-1, num_blocks * block_size - 1], device="cuda")
    cos_sin = RotaryEmbedding(head_dim, 64, 1e6).cos_sin_cache.cuda()
    positions = torch.tensor([3, 60], device="cuda")
    _, key = qk_norm_rope_store(q, key, value, positions, cos_sin, None, None, 1e-6, k_cache, v_cache, slots)
    assert torch.equal(k_cache[-1, -1], key[1]) and torch.equal(v_cache[-1, -1], value[1])


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["cache_as_model", "fp8_cache"])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_store(dtype: torch.dtype, norm: bool, cache_dtype) -> None:
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 4096, 16, 8, 128, 256
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device="cuda")
    qkv = qkv.to(dtype)
    q, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    value = qkv[:, num_heads + num_kv_heads :]
    positions = torch.randint(0, 40960, (num_tokens,), device="cuda")
    cos_sin = RotaryEmbedding(head_dim, 40960, 1e6).cos_sin_cache.cuda()
    weights = (1 + 0.1 * torch.randn(2, head_dim, device="cuda")).to(dtype).unbind() if norm else (None, None)
    slots = torch.randperm(40 * block_size, device="cuda")[:num_tokens]
    slots[::7] = -1
    value.mul_(300)  # some values pass float8's largest, 448: both saturate
    k_cache = torch.randn(40, block_size, num_kv_heads, head_dim, device="cuda").to(cache_dtype or dtype)
    v_cache = torch.randn_like(k_cache.float()).to(k_cache.dtype)
    layout = KVLayout.for_dtype(k_cache.dtype)  # as the engine stores it
    v_cache = layout.v_view(torch.empty_like(v_cache)).copy_(v_cache)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    args = (positions, cos_sin, *weights, 1e-6)
    want_q, want_k = qk_norm_rope_store_ref(q, key, value, *args, ref_k, ref_v, slots, layout=layout)
    got_q, got_k = qk_norm_rope_store(q, key, value, *args, k_cache, v_cache, slots, layout=layout)
    # fp32 math inside both; the kernel may round a product or two differently before the cast
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k, want_k, atol=tol, rtol=tol)
    if cache_dtype is None:
        torch.testing.assert_close(k_cache, ref_k, atol=tol, rtol=tol)
    else:  # rounded to nearest on both sides; a k that differs in its last bit may round apart
        torch.testing.assert_close(k_cache.float(), ref_k.float(), atol=2**-9, rtol=0.125)
    assert torch.equal(v_cache.float(), ref_v.float())


# (block_size, num_heads, num_kv_heads, head_dim, [(cached prefix, new tokens), ...])
PREFILL_CASES = [
    (256, 16, 8, 128, [(0, 2048), (1000, 1), (4097, 513), (300, 77)]),
    (16, 32, 4, 128, [(0, 1500), (16 * 37 + 5, 300), (0, 1)]),
    (64, 16, 16, 64, [(8191, 1024), (0, 17)]),
    (16, 16, 2, 128, [(p, n) for p, n in zip(range(0, 4096, 64), range(1, 256, 4))]),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,seqs", PREFILL_CASES)
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["cache_as_model", "fp8_cache"])
def test_prefill(block_size, num_heads, num_kv_heads, head_dim, seqs, dtype, cache_dtype) -> None:
    q_lens = [n for _, n in seqs]
    lens = [p + n for p, n in seqs]
    k_cache, v_cache, tables, ctx = paged_cache(
        lens, block_size, num_kv_heads, head_dim, dtype, cache_dtype=cache_dtype
    )
    q = torch.randn(sum(q_lens), num_heads, head_dim, device="cuda", dtype=dtype) * Q_GAIN
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    scale = head_dim**-0.5
    layout = KVLayout.for_dtype(k_cache.dtype)
    out = paged_prefill_attention(q, k_cache, v_cache, cu, ctx, tables, scale, max(q_lens), layout=layout)
    check(out, paged_prefill_attention_ref(q, k_cache, v_cache, cu, ctx, tables, scale))


@pytest.mark.parametrize("rows,vocab", [(1, 151936), (256, 151936), (7, 1000)])
def test_sample(rows: int, vocab: int) -> None:
    torch.manual_seed(rows)
    logits = (torch.randn(rows, vocab, device="cuda") * 4).bfloat16()
    temps = torch.rand(rows, device="cuda") + 0.3
    temps[::5] = 0.0
    uniforms = torch.rand(rows, device="cuda")
    out, ref = sample_tokens(logits, temps, uniforms), sample_tokens_ref(logits, temps, uniforms)
    greedy = temps == 0
    assert torch.equal(out[greedy], logits.float().argmax(-1)[greedy])
    # off the greedy rows, a pick may differ only where the uniform sits on an interval edge
    probs = (logits.float() / temps.clamp(min=1e-6).unsqueeze(1)).softmax(-1).double()
    cdf = probs.cumsum(-1)
    target = uniforms.double() * cdf[:, -1]
    rows_ = torch.arange(rows, device="cuda")
    below = torch.where(out > 0, cdf[rows_, (out - 1).clamp(min=0)], 0.0)
    ok = (below <= target + 1e-5) & (cdf[rows_, out] > target - 1e-5) & (probs[rows_, out] > 0)
    assert ok[~greedy].all()
    assert (out == ref).float().mean().item() >= 0.95


def test_sample_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, device="cuda") * 2
    n = 200_000
    batch = logits.expand(n, -1).contiguous().bfloat16()
    temps = torch.full((n,), 0.7, device="cuda")
    counts = torch.bincount(sample_tokens(batch, temps, torch.rand(n, device="cuda")), minlength=16)
    probs = (batch[0].float() / 0.7).softmax(-1).double()
    expected = probs * n
    chi2 = (((counts.double() - expected) ** 2) / expected).sum().item()
    assert chi2 < 50.0, chi2  # 99.99% quantile of chi-square with 15 degrees of freedom: 44.3


def test_seeded_sample_matches_reference_on_device() -> None:
    torch.manual_seed(3)
    rows, vocab = 64, 151936
    logits = (torch.randn(rows, vocab, device="cuda") * 4).bfloat16()
    temps = torch.rand(rows, device="cuda") + 0.3
    seeds = torch.randint(-(2**62), 2**62, (rows,), device="cuda")
    steps = torch.randint(0, 5000, (rows,), device="cuda")
    steps[::4] = -1  # unseeded rows
    uniforms = torch.rand(rows, device="cuda")
    out = sample_tokens(logits, temps, uniforms, seeds, steps)
    ref = sample_tokens_ref(logits, temps, uniforms, seeds, steps)
    assert (out == ref).float().mean().item() >= 0.95
    # a seeded row alone draws the same token
    for row in (1, 2, 3, 5):
        args = (logits[row : row + 1], temps[row : row + 1], torch.rand(1, device="cuda"))
        assert sample_tokens(*args, seeds[row : row + 1], steps[row : row + 1]).item() == out[row].item()
