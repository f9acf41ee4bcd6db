"""The fused SwiGLU kernel vs its torch reference (interpreter on CPU, device on GPU), and the
reference vs Hugging Face's activation."""

import pytest
import torch
from transformers.activations import ACT2FN

from nanovllm.kernels.fp8 import FP8
from nanovllm.kernels.silu_and_mul import (
    silu_and_mul,
    silu_and_mul_fp8,
    silu_and_mul_fp8_ref,
    silu_and_mul_ref,
)
from tests.interpreter import DEVICE, DTYPES
from tests.kernels.fp8_close import assert_fp8_close

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # exp's last bits, then a rounding


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 96), (3, 5, 2 * 1100), (1, 2 * 3072), (0, 64)])
def test_kernel_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = (4 * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)
    out = silu_and_mul(x)
    want = silu_and_mul_ref(x)
    assert out.shape == want.shape == (*shape[:-1], shape[-1] // 2)
    # both round silu to the dtype, then the product; only exp's last bits may differ
    torch.testing.assert_close(out, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_reference_with_gate_and_up_side_by_side():
    x = 4 * torch.randn(7, 2 * 96, dtype=torch.bfloat16)
    pairs = torch.stack(x.chunk(2, dim=-1), dim=-1).flatten(-2)  # the same pairs, interleaved
    # silu's vectorised and strided paths may differ in a last bit
    want = silu_and_mul_ref(pairs)
    torch.testing.assert_close(silu_and_mul_ref(x, halves=True), want, atol=8e-3, rtol=8e-3)


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 96), (3, 2 * 2100), (1, 2 * 3072), (64, 2 * 5000), (0, 64)])
@pytest.mark.parametrize(
    "tiles",
    [
        {},
        dict(block=256, num_warps=4),
        dict(block=8192),
        dict(block=256, chunks=3),  # a row's stores split over programs, the last chunk shorter
        dict(block=256, chunks=3, paired=False),
        dict(block=8192, paired=False),
    ],
    ids=["default", "steps", "whole_row", "chunks", "chunks_strided", "whole_row_strided"],
)
def test_fp8_kernel_matches_reference(dtype, shape, tiles):
    """The same SwiGLU values rounded per token: scales agree to the dtype's rounding of the
    largest value, and each e4m3 value is the reference's or (where exp's last bits moved the
    SwiGLU value across a rounding boundary) one e4m3 step from it."""
    gen = torch.Generator().manual_seed(1)
    x = (4 * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)
    x[:, :2] = torch.tensor([20.0, 30.0])  # one large value per row: small ones round coarsely
    q, scale = silu_and_mul_fp8(x, **tiles)
    q_ref, scale_ref = silu_and_mul_fp8_ref(x)
    assert q.dtype == q_ref.dtype == FP8 and q.shape == q_ref.shape == (shape[0], shape[1] // 2)
    assert scale.shape == scale_ref.shape == (shape[0], 1)
    if not shape[0]:
        return
    assert_fp8_close((q, scale), (q_ref, scale_ref), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 96), (3, 2 * 2100), (64, 2 * 1536), (0, 256)])
@pytest.mark.parametrize("halves", [False, True], ids=["interleaved", "halves"])
@pytest.mark.parametrize("group", [None, 128], ids=["per_token", "per_group"])
def test_fp8_kernel_layouts_and_groups_match_reference(dtype, shape, halves, group):
    """Gate and up side by side (FP8 checkpoints' block layout) or interleaved, rounded per token
    or per token and 128 features (a last group partial where 128 does not divide the row)."""
    gen = torch.Generator().manual_seed(2)
    x = (4 * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)
    q, scale = silu_and_mul_fp8(x, halves=halves, group=group)
    q_ref, scale_ref = silu_and_mul_fp8_ref(x, halves=halves, group=group)
    size = shape[1] // 2
    assert scale.shape == scale_ref.shape == (shape[0], -(-size // group) if group else 1)
    if shape[0]:
        assert_fp8_close((q, scale), (q_ref, scale_ref), TOL[dtype])


def test_fp8_kernel_on_a_strided_view_and_bad_inputs():
    x = torch.randn(6, 2 * 80, dtype=torch.float32, device=DEVICE)
    q, scale = silu_and_mul_fp8(x[::2])
    q_ref, scale_ref = silu_and_mul_fp8_ref(x[::2])
    assert (q.float() == q_ref.float()).float().mean() > 0.99
    torch.testing.assert_close(scale, scale_ref, atol=0, rtol=1e-6)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_fp8(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="2-d"):
        silu_and_mul_fp8(torch.zeros(2, 2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="unit stride"):
        silu_and_mul_fp8(torch.zeros(8, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="chunks"):
        silu_and_mul_fp8(x, chunks=0)
    with pytest.raises(ValueError, match="power of two"):
        silu_and_mul_fp8(x, group=100)
    with pytest.raises(ValueError, match="interleaved"):
        silu_and_mul_fp8(x, paired=True, halves=True)


def test_fp8_reference_is_the_quantized_swiglu():
    """The reference is the model-dtype SwiGLU rounded as the FP8 layers round any input."""
    x = torch.randn(5, 2 * 48, dtype=torch.bfloat16)
    q, scale = silu_and_mul_fp8_ref(x)
    h = silu_and_mul_ref(x).float()
    assert torch.equal(scale[:, 0], (h.abs().amax(dim=1) / 448).clamp(min=torch.finfo(torch.float32).tiny))
    assert torch.equal(q, (h / scale).clamp(-448, 448).to(FP8))
