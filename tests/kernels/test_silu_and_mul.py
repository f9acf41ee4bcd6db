"""The fused SwiGLU kernel vs its torch reference (interpreter on CPU, device on GPU), and the
reference vs Hugging Face's activation."""

import pytest
import torch
from transformers.activations import ACT2FN

from nanovllm.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from tests.interpreter import DEVICE

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 96), (3, 5, 2 * 1100), (1, 2 * 3072), (0, 64)])
def test_kernel_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = (4 * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)
    out = silu_and_mul(x)
    want = silu_and_mul_ref(x)
    assert out.shape == want.shape == (*shape[:-1], shape[-1] // 2)
    # both round silu to the dtype, then the product; only exp's last bits may differ
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)


def test_kernel_on_a_strided_view():
    x = torch.randn(6, 2 * 80, dtype=torch.float32, device=DEVICE)
    torch.testing.assert_close(silu_and_mul(x[::2]), silu_and_mul_ref(x[::2]), atol=1e-6, rtol=1e-6)


def test_bad_inputs():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="unit stride"):
        silu_and_mul(torch.zeros(8, 4, device=DEVICE).t())


def test_reference_is_hf_swiglu():
    gate, up = torch.randn(2, 9, 40, dtype=torch.bfloat16).unbind(0)
    want = ACT2FN["silu"](gate) * up  # Qwen3MLP / LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    pairs = torch.stack([gate, up], dim=-1).flatten(-2)  # gate j at 2j, up j at 2j + 1
    assert torch.equal(silu_and_mul_ref(pairs), want)
