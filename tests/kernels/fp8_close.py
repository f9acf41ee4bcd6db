"""The check of a kernel that rounds its output to FP8 per token against its torch reference,
where the two compute the values being rounded up to their last bits."""

import torch

from nanovllm.kernels.fp8 import FP8


def assert_fp8_close(got, want, scale_rtol: float) -> None:
    """``got`` and ``want``: ``(e4m3 values, scales)``. The scales agree within ``scale_rtol`` (the
    dtype's rounding of the largest value); each e4m3 value is the reference's or, where the last
    bits moved a value across a rounding boundary, one e4m3 step from it; 99% are the same."""
    (q, scale), (q_ref, scale_ref) = got, want
    assert q.dtype == q_ref.dtype == FP8 and q.shape == q_ref.shape and scale.shape == scale_ref.shape
    torch.testing.assert_close(scale, scale_ref, atol=0, rtol=scale_rtol)
    values, ref = q.float().cpu(), q_ref.float().cpu()
    step = torch.maximum(ref.abs() / 8, torch.full_like(ref, 2.0**-9))  # e4m3: 3 mantissa bits
    assert ((values - ref).abs() <= step).all()
    assert (values == ref).float().mean() > 0.99
