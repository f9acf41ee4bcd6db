"""The fused linear kernel (RMSNorm before, SwiGLU or a residual add after) vs its torch
reference, and the reference vs the model's own layers (interpreter on CPU, device on GPU)."""

import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels.fused_linear import fused_linear, fused_linear_ref
from nanovllm.kernels.silu_and_mul import silu_and_mul_ref
from nanovllm.layers.layernorm import rms_norm
from tests.interpreter import DEVICE

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _inputs(rows: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    norm = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
    res = torch.randn(rows, n, generator=gen).to(dtype).to(DEVICE)
    bias = (0.1 * torch.randn(n, generator=gen)).to(dtype).to(DEVICE)
    return x, w, norm, res, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "k", "n"), [(1, 64, 96), (5, 200, 72), (37, 96, 160)])
@pytest.mark.parametrize("mode", ["plain", "bias", "norm", "norm+swiglu", "residual"])
def test_kernel_matches_reference(dtype, rows, k, n, mode):
    x, w, norm, res, bias = _inputs(rows, k, n, dtype)
    kwargs = {
        "plain": {},
        "bias": {"bias": bias},
        "norm": {"norm_weight": norm, "eps": 1e-5},
        "norm+swiglu": {"norm_weight": norm, "swiglu": True},
        "residual": {"residual": res},
    }[mode]
    out = fused_linear(x, w, **kwargs)
    want = fused_linear_ref(x, w, **kwargs)
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_residual_in_place():
    x, w, _, res, _ = _inputs(9, 64, 48, torch.float32)
    want = fused_linear_ref(x, w, residual=res)
    out = fused_linear(x, w, residual=res, out=res)
    assert out.data_ptr() == res.data_ptr()
    torch.testing.assert_close(res, want, atol=1e-4, rtol=1e-4)


def test_reference_is_the_layers_it_replaces():
    """RMSNorm then a projection, SwiGLU on a gate/up projection, a residual add: what the
    decoder layer computes with separate ops, rounded at the same places."""
    x, w, norm, res, _ = _inputs(6, 64, 128, torch.bfloat16)
    x, w, norm, res = x.cpu(), w.cpu(), norm.cpu(), res.cpu()
    normed = rms_norm(x, norm, 1e-6)
    assert torch.equal(fused_linear_ref(x, w, norm_weight=norm), F.linear(normed, w))
    swiglu = silu_and_mul_ref(F.linear(normed, w))
    assert torch.equal(fused_linear_ref(x, w, norm_weight=norm, swiglu=True), swiglu)
    assert torch.equal(fused_linear_ref(x, w[:64], residual=res[:, :64]), res[:, :64] + F.linear(x, w[:64]))


def test_bad_inputs():
    x, w, norm, res, bias = _inputs(4, 32, 48, torch.float32)
    with pytest.raises(ValueError, match="features"):
        fused_linear(x, w[:, :16])
    with pytest.raises(ValueError, match="even"):
        fused_linear(x, w[:47], swiglu=True)
    with pytest.raises(ValueError, match="bias"):
        fused_linear(x, w, bias=bias, swiglu=True)
    with pytest.raises(ValueError, match="norm_weight"):
        fused_linear(x, w, norm_weight=norm[:8])
    with pytest.raises(ValueError, match="residual"):
        fused_linear(x, w, residual=res[:, :8])
    with pytest.raises(ValueError, match="unit stride"):
        fused_linear(x.t().contiguous().t(), w)
