"""The fused q/k norm + rotary + KV store kernel vs its torch reference (interpreter on CPU),
and the reference vs Hugging Face's Qwen3 q/k norm and rotary embedding."""

import pytest
import torch

from nanovllm.kernels.kv_layout import KVLayout
from nanovllm.kernels.qk_norm_rope_store import qk_norm_rope_store, qk_norm_rope_store_ref, store_kvcache_ref
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from tests.interpreter import DEVICE

# on a GPU machine these run on the device too (``-m gpu``); on CPU, under the interpreter
pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def make_inputs(num_tokens, heads, kv_heads, head_dim, dtype, norm: bool, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # q, k, v as views into one fused projection output, as the model passes them
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, heads, head_dim)
    k, v = k.view(num_tokens, kv_heads, head_dim), v.view(num_tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4000, (num_tokens,), generator=gen)
    weights = (1 + 0.1 * torch.randn(2, head_dim, generator=gen)).to(dtype) if norm else [None, None]
    num_slots = 8 * 16
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::3] = -1  # padding rows store nothing
    cache = torch.zeros(8, 16, kv_heads, head_dim, dtype=dtype)
    return qkv, q, k, v, positions, weights[0], weights[1], slots, cache


def token_major_copy(cache: torch.Tensor) -> torch.Tensor:
    return KVLayout.V_TOKEN_MAJOR.v_view(torch.empty_like(cache)).copy_(cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (16, 8, 128), (6, 2, 32)])
@pytest.mark.parametrize("layout", list(KVLayout), ids=[layout.value for layout in KVLayout])
def test_kernel_matches_reference(dtype, norm, heads, kv_heads, head_dim, layout):
    rope = RotaryEmbedding(head_dim, 4096, 1e6)
    qkv, q, k, v, positions, qw, kw, slots, cache = make_inputs(11, heads, kv_heads, head_dim, dtype, norm)
    want_q, want_k = qk_norm_rope_store_ref(
        q, k, v, positions, rope.cos_sin_cache, qw, kw, 1e-6, cache.clone(), cache.clone(), slots
    )
    want_kc, want_vc = cache.clone(), cache.clone()
    store_kvcache_ref(want_k, v, want_kc, want_vc, slots)

    qkv, kc, vc = qkv.to(DEVICE), cache.clone().to(DEVICE), cache.clone().to(DEVICE)
    vc = layout.v_view(torch.empty_like(vc)).copy_(vc)
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    q, k, v = qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=-1)
    q = q.view(11, heads, head_dim)
    k, v = k.view(11, kv_heads, head_dim), v.view(11, kv_heads, head_dim)
    weights = [w.to(DEVICE) if w is not None else None for w in (qw, kw)]
    args = (positions.to(DEVICE), rope.cos_sin_cache.to(DEVICE), *weights, 1e-6)
    got_q, got_k = qk_norm_rope_store(q, k, v, *args, kc, vc, slots.to(DEVICE), layout=layout)
    assert got_q.data_ptr() == q.data_ptr(), "q is rewritten in place"
    tol = TOL[dtype]
    torch.testing.assert_close(got_q.cpu(), want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k.cpu(), want_k, atol=tol, rtol=tol)
    torch.testing.assert_close(kc.cpu(), want_kc, atol=tol, rtol=tol)
    torch.testing.assert_close(vc.cpu(), want_vc, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_keeps_a_token_major_v_finite(dtype):
    """As the reference: NaN stored as 0, infinities as the cache dtype's largest."""
    rope = RotaryEmbedding(64, 4096, 1e6)
    _, q, k, v, positions, qw, kw, slots, cache = make_inputs(11, 4, 2, 64, dtype, True)
    v = v.clone()
    v[1, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    v[4] = float("nan")
    cos_sin = rope.cos_sin_cache
    want_k, want_v = cache.clone(), token_major_copy(cache)
    args = (positions, cos_sin, qw, kw, 1e-6)
    layout = KVLayout.V_TOKEN_MAJOR
    qk_norm_rope_store_ref(q.clone(), k.clone(), v, *args, want_k, want_v, slots, layout=layout)
    assert want_v.isfinite().all()
    q, k, v, positions, cos_sin, qw, kw, slots = (
        t.clone().to(DEVICE) for t in (q, k, v, positions, cos_sin, qw, kw, slots)
    )
    k_cache, v_cache = cache.clone().to(DEVICE), token_major_copy(cache).to(DEVICE)
    qk_norm_rope_store(q, k, v, positions, cos_sin, qw, kw, 1e-6, k_cache, v_cache, slots, layout=layout)
    assert torch.equal(v_cache.cpu(), want_v)


def test_reference_is_hf_qwen3_norm_and_rotary():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    heads, kv_heads, head_dim, base = 4, 2, 64, 1e6
    rope = RotaryEmbedding(head_dim, 4096, base)
    _, q, k, v, positions, qw, kw, slots, cache = make_inputs(
        9, heads, kv_heads, head_dim, torch.float32, True
    )
    kc, vc = cache.clone(), cache.clone()
    got_q, got_k = qk_norm_rope_store_ref(q, k, v, positions, rope.cos_sin_cache, qw, kw, 1e-6, kc, vc, slots)
    q_norm, k_norm = Qwen3RMSNorm(head_dim, 1e-6), Qwen3RMSNorm(head_dim, 1e-6)
    q_norm.weight.data, k_norm.weight.data = qw, kw
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)  # [tokens, head_dim]
    with torch.no_grad():  # HF's layout: [batch, heads, tokens, head_dim]
        hf_q, hf_k = apply_rotary_pos_emb(
            q_norm(q).transpose(0, 1)[None],
            k_norm(k).transpose(0, 1)[None],
            freqs.cos()[None],
            freqs.sin()[None],
        )
    torch.testing.assert_close(got_q, hf_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, hf_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    stored = slots >= 0
    assert torch.equal(kc.view(-1, kv_heads, head_dim)[slots[stored]], got_k[stored])
    assert torch.equal(vc.view(-1, kv_heads, head_dim)[slots[stored]], v[stored])


def test_bad_inputs_are_refused():
    rope = RotaryEmbedding(48, 64, 1e4)
    _, q, k, v, positions, qw, _, slots, cache = make_inputs(3, 2, 1, 48, torch.float32, True)
    with pytest.raises(ValueError, match="power of two"):
        qk_norm_rope_store(q, k, v, positions % 64, rope.cos_sin_cache, qw, qw, 1e-6, cache, cache, slots)
    rope = RotaryEmbedding(64, 64, 1e4)
    _, q, k, v, positions, qw, _, slots, cache = make_inputs(3, 2, 1, 64, torch.float32, True)
    with pytest.raises(ValueError, match="go together"):
        qk_norm_rope_store(q, k, v, positions % 64, rope.cos_sin_cache, qw, None, 1e-6, cache, cache, slots)
