"""Long prompts without a cached prefix go through cuDNN's attention on Hopper (the Triton
backend): which prompts it takes, and on the GPU the attention layer's output against the
plain-torch paged reference, one and several prompts a step, q/k/v as views of one
projection's output as in the model."""

import pytest
import torch
from torch.nn.attention import SDPBackend

import nanovllm.attention.cudnn_prefill as cudnn_prefill
import nanovllm.attention.triton_backend as triton_backend
from nanovllm.attention import AttentionMetadata, QKTransform, get_attention_backend
from nanovllm.attention.cudnn_prefill import (
    MIN_PROMPT_TOKENS,
    bucket_length,
    bucket_lengths,
    cudnn_causal_prefill,
    cudnn_prefill_supported,
    takes_prompts,
)
from nanovllm.kernels.prefill_attention import paged_prefill_attention_ref
from nanovllm.layers.attention import Attention

on_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or not cudnn_prefill_supported(torch.device("cuda")),
    reason="needs cuDNN's attention on a Hopper GPU",
)
BLOCK, HEADS, KV_HEADS, HEAD_DIM = 256, 32, 8, 128


def test_takes_only_long_half_precision_prompts_over_a_cache_of_their_dtype():
    bf16, fp16 = torch.bfloat16, torch.float16
    assert takes_prompts((MIN_PROMPT_TOKENS, 5000), bf16, bf16)
    assert takes_prompts((MIN_PROMPT_TOKENS,), fp16, fp16)
    assert not takes_prompts((MIN_PROMPT_TOKENS, MIN_PROMPT_TOKENS - 1), bf16, bf16)
    assert not takes_prompts((5000,), torch.float32, torch.float32)
    assert not takes_prompts((5000,), bf16, torch.float8_e4m3fn)
    assert not takes_prompts((), bf16, bf16)


def test_buckets_pad_under_an_eighth_and_are_their_own_buckets():
    assert bucket_length(MIN_PROMPT_TOKENS) == MIN_PROMPT_TOKENS
    assert [bucket_length(n) for n in (2049, 2304, 2305, 4097, 8192, 8193)] == [
        2304,
        2304,
        2560,
        4608,
        8192,
        9216,
    ]
    for n in range(MIN_PROMPT_TOKENS, 20_000, 7):
        b = bucket_length(n)
        assert n <= b < n * 9 / 8 and bucket_length(b) == b
    buckets = bucket_lengths(16384)
    assert buckets[0] == MIN_PROMPT_TOKENS and buckets[-1] == 16384 and len(buckets) == 25
    assert buckets == sorted(set(bucket_length(n) for n in range(MIN_PROMPT_TOKENS, 16385)))
    assert bucket_lengths(5000)[-1] == bucket_length(5000)


def test_prompts_padded_to_their_bucket_attend_as_unpadded(monkeypatch):
    # the padding logic on CPU, through SDPA's plain implementation
    monkeypatch.setattr(cudnn_prefill, "_BACKENDS", [SDPBackend.MATH])
    lengths, heads, kv_heads, dim = (40, 64, 33), 4, 2, 16
    monkeypatch.setattr(cudnn_prefill, "bucket_length", lambda n: -(-n // 32) * 32)  # 64, 64, 64
    tokens = sum(lengths)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, dtype=torch.float64)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    out = cudnn_causal_prefill(q, k, v, lengths, 0.3)
    start = 0
    for n in lengths:
        qs, ks, vs = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
        ks, vs = (x.repeat_interleave(heads // kv_heads, dim=0) for x in (ks, vs))
        expected = (
            torch.softmax(
                (qs @ ks.transpose(1, 2) * 0.3).masked_fill(
                    torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")
                ),
                dim=-1,
            )
            @ vs
        )
        torch.testing.assert_close(out[start : start + n], expected.transpose(0, 1))
        start += n


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize(
    "lengths", [(MIN_PROMPT_TOKENS + 37,), (MIN_PROMPT_TOKENS, 3000, MIN_PROMPT_TOKENS + 5)]
)
def test_long_prompts_attend_as_the_paged_reference(lengths, monkeypatch):
    monkeypatch.setattr(cudnn_prefill, "ENABLED", True)
    calls = []
    monkeypatch.setattr(
        triton_backend, "cudnn_causal_prefill", lambda *a: calls.append(1) or cudnn_causal_prefill(*a)
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = sum(lengths)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(tokens, width, generator=gen, device="cuda", dtype=torch.bfloat16)
    q, k, v = (
        x.view(tokens, -1, HEAD_DIM)
        for x in qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    )
    blocks = [-(-n // BLOCK) for n in lengths]
    tables = torch.full((len(lengths), max(blocks)), 0, dtype=torch.int32)
    slot_mapping, first = [], 0
    for row, (n, b) in enumerate(zip(lengths, blocks)):
        tables[row, :b] = torch.arange(first, first + b)
        slot_mapping += [first * BLOCK + p for p in range(n)]
        first += b
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.tensor(slot_mapping, device="cuda"),
        context_lens=torch.tensor(lengths, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(),
        cu_seqlens_q=cu.cuda(),
        max_seqlen_q=max(lengths),
        seqlens_q=lengths,
    )
    layer = Attention(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, get_attention_backend("triton"))
    cache_shape = (first, BLOCK, KV_HEADS, HEAD_DIM)
    layer.k_cache = torch.zeros(cache_shape, dtype=torch.bfloat16, device="cuda")
    layer.v_cache = torch.zeros_like(layer.k_cache)
    # a rotary table of cos 1, sin 0 leaves q and k as they are: this test is about attention
    identity = torch.cat((torch.ones(8192, HEAD_DIM // 2), torch.zeros(8192, HEAD_DIM // 2)), dim=-1)
    positions = torch.cat([torch.arange(n) for n in lengths])
    out = layer(q, k, v, QKTransform(positions.cuda(), identity.cuda()), meta)
    assert len(calls) == 1
    assert out.shape == (tokens, HEADS, HEAD_DIM) and out.is_contiguous()
    cache = (layer.k_cache, layer.v_cache)
    expected = paged_prefill_attention_ref(
        q, *cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, HEAD_DIM**-0.5
    )
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
