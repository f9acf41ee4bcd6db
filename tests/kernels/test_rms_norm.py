"""The RMSNorm kernel, in the model dtype and rounded to FP8 (with and without the residual add),
vs its torch references (interpreter on CPU, device on GPU), and the references vs Hugging
Face's RMSNorm."""

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from nanovllm.kernels.fp8 import FP8
from nanovllm.kernels.rms_norm import add_rms_norm_ref, rms_norm, rms_norm_fp8, rms_norm_fp8_ref, rms_norm_ref
from tests.interpreter import DEVICE, DTYPES
from tests.kernels.fp8_close import assert_fp8_close

pytestmark = pytest.mark.gpu


def inputs(rows: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype)
    return x.to(DEVICE), residual.to(DEVICE), weight.to(DEVICE)


RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # sums of squares' last bits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 1024), (7, 4096), (33, 96), (5, 2000), (0, 128)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
def test_kernel_matches_reference(dtype, rows, hidden, with_residual):
    """In the model dtype: the sum one rounding of an exact fp32 sum, so equal; the norm within
    one rounding of the dtype (the sum of squares' and the reciprocal square root's last bits)."""
    x, residual, weight = inputs(rows, hidden, dtype)
    if with_residual:
        normed, summed = rms_norm(x, weight, 1e-6, residual)
        normed_ref, summed_ref = add_rms_norm_ref(x, residual, weight, 1e-6)
        assert torch.equal(summed, summed_ref) and summed.is_contiguous()
    else:
        normed, summed = rms_norm(x, weight, 1e-6)
        normed_ref = rms_norm_ref(x, weight, 1e-6)
        assert summed is None
    assert normed.dtype == dtype and normed.shape == (rows, hidden)
    torch.testing.assert_close(normed, normed_ref, atol=RTOL[dtype], rtol=RTOL[dtype])


def test_kernel_on_strided_rows_and_bad_inputs():
    x, residual, weight = inputs(8, 2 * 256, torch.float32)
    x, residual, weight = x[::2, :256], residual[::2, 256:], weight[:256]
    normed, summed = rms_norm(x, weight, 1e-5, residual)
    normed_ref, summed_ref = add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(summed, summed_ref)
    torch.testing.assert_close(normed, normed_ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[:8], 1e-6)
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm(x.t().contiguous().t(), weight, 1e-6)
    with pytest.raises(ValueError, match="above"):
        wide = torch.zeros(1, 32768, device=DEVICE)
        rms_norm(wide, wide[0], 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 1024), (7, 4096), (33, 96), (5, 2000), (0, 128)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
def test_fp8_kernel_matches_reference(dtype, rows, hidden, with_residual):
    x, residual, weight = inputs(rows, hidden, dtype)
    res = residual if with_residual else None
    q, scale, summed = rms_norm_fp8(x, weight, 1e-6, res)
    q_ref, scale_ref, summed_ref = rms_norm_fp8_ref(x, weight, 1e-6, res)
    assert scale.shape == (rows, 1)
    if with_residual:
        assert torch.equal(summed, summed_ref)  # one rounding of an exact fp32 sum
    else:
        assert summed is None and summed_ref is None
    if rows:
        assert_fp8_close((q, scale), (q_ref, scale_ref), RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 1024), (7, 4096), (5, 2000), (3, 64), (0, 128)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
def test_fp8_kernel_per_group_of_features_matches_reference(dtype, rows, hidden, with_residual):
    """Block-scaled consumers: one scale per token and 128 features (a last group partial when
    128 does not divide the row, the whole row one group when it is shorter)."""
    x, residual, weight = inputs(rows, hidden, dtype)
    res = residual if with_residual else None
    q, scale, summed = rms_norm_fp8(x, weight, 1e-6, res, group=128)
    q_ref, scale_ref, summed_ref = rms_norm_fp8_ref(x, weight, 1e-6, res, group=128)
    assert scale.shape == scale_ref.shape == (rows, -(-hidden // 128))
    if with_residual:
        assert torch.equal(summed, summed_ref)
    if rows:
        assert_fp8_close((q, scale), (q_ref, scale_ref), RTOL[dtype])


def test_fp8_kernel_on_strided_rows_and_bad_inputs():
    x, residual, weight = inputs(8, 2 * 256, torch.float32)
    x, residual, weight = x[::2, :256], residual[::2, 256:], weight[:256]
    q, scale, summed = rms_norm_fp8(x, weight, 1e-5, residual)
    q_ref, scale_ref, summed_ref = rms_norm_fp8_ref(x, weight, 1e-5, residual)
    assert torch.equal(summed, summed_ref) and summed.is_contiguous()
    assert_fp8_close((q, scale), (q_ref, scale_ref), RTOL[torch.float32])
    with pytest.raises(ValueError, match="2-d"):
        rms_norm_fp8(x[None], weight, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_fp8(x, weight[:8], 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_fp8(x, weight, 1e-6, residual[:2])
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm_fp8(x.t().contiguous().t(), weight, 1e-6)
    with pytest.raises(ValueError, match="power of two"):
        rms_norm_fp8(x, weight, 1e-6, group=96)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_are_hf_rms_norm(dtype):
    x, residual, weight = (t.cpu() for t in inputs(6, 64, dtype, seed=1))
    hf = Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    hf.weight.data.copy_(weight)
    assert torch.equal(rms_norm_ref(x, weight, 1e-6), hf(x))
    summed = (x.float() + residual.float()).to(dtype)
    normed, got_sum = add_rms_norm_ref(x, residual, weight, 1e-6)
    assert torch.equal(got_sum, summed) and torch.equal(normed, hf(summed))
    q, scale, _ = rms_norm_fp8_ref(x, weight, 1e-6)
    h = hf(x).float()
    assert torch.equal(scale[:, 0], (h.abs().amax(dim=1) / 448).clamp(min=torch.finfo(torch.float32).tiny))
    assert torch.equal(q, (h / scale).clamp(-448, 448).to(FP8))
