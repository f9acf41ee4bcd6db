"""The FP8 quantizer kernel vs its torch reference (interpreter on CPU, compiled on CUDA), and the
quantizers' round trips vs e4m3's precision (the product: ``test_fp8_gemm.py``)."""

import pytest
import torch

from nanovllm.kernels import fp8
from tests.interpreter import DEVICE
from tests.kernels.fp8_inputs import expand, random_activations

IN_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def as_bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def check_quantizer(x: torch.Tensor, group: int):
    q, s = fp8.quantize_per_token_group(x, group)
    q_ref, s_ref = fp8.quantize_per_token_group_ref(x, group)
    groups = -(-x.shape[1] // group)
    assert q.dtype == fp8.FP8 and q.shape == x.shape and s.shape == (x.shape[0], groups)
    assert torch.equal(as_bytes(q), as_bytes(q_ref))
    assert torch.equal(s, s_ref)
    return q, s


@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("k", [100, 256, 384])
def test_quantizer_matches_reference(dtype, m, k):
    x = random_activations(m, k, dtype, seed=m * k).to(DEVICE)
    q, s = check_quantizer(x, 128)
    # each nonzero group's largest element becomes +-448
    x64 = x.cpu().double()
    for g in range(s.shape[1]):
        cols = slice(128 * g, 128 * (g + 1))
        amax = x64[:, cols].abs().amax(1)
        assert torch.equal(q[:, cols].cpu().float().abs().amax(1), torch.where(amax > 0, 448.0, 0.0).float())
    if m > 1:
        assert (q[m // 2].cpu().float() == 0).all() and (s[m // 2] == fp8.MIN_SCALE).all()


@pytest.mark.parametrize("group", [32, 100, 512])
def test_quantizer_other_groups_and_per_token(group):
    x = random_activations(5, 300, torch.bfloat16, seed=group).to(DEVICE)
    check_quantizer(x, group)
    _, s = check_quantizer(x, 300)  # one group per token
    assert s.shape == (5, 1)


def test_quantizer_rounds_as_torch_casts():
    """With a scale of 1 (448 in every group): each e4m3 value, each midpoint between neighbours
    (ties: to the even one), the fp32 values either side of each midpoint, both signs, and
    subnormals; the interpreter's own cast gets ties and carries into the exponent wrong."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(fp8.FP8).float()  # 0 ... 448
    mid = (grid[:-1] + grid[1:]) / 2
    vals = torch.cat([grid, mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e3))])
    vals = torch.cat([vals, -vals, torch.tensor([-0.0, 2.0**-10, 3 * 2.0**-10, 447.9, 2.0**-126])])
    pad = (-len(vals)) % 127
    x = torch.cat([vals, torch.zeros(pad)]).view(-1, 127)
    x = torch.cat([x, torch.full((x.shape[0], 1), 448.0)], dim=1).to(DEVICE)
    q, s = check_quantizer(x, 128)
    assert (s == 1).all()
    got = q.cpu()[:, :127].reshape(-1)[: len(vals)]
    assert as_bytes(got)[len(vals) - 5].item() == 0x80  # -0.0 keeps its sign
    got = got.float()
    ties = got[len(grid) : len(grid) + len(mid)]
    assert (torch.frexp(ties[ties > 2.0**-6]).mantissa * 16 % 2 == 0).all()  # even 3-bit mantissa
    assert torch.equal(got[: len(grid)], grid)


@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_quantizer_large_magnitudes(dtype):
    big = {torch.bfloat16: 3e38, torch.float16: 65504.0, torch.float32: 3.4e38}[dtype]
    x = random_activations(6, 256, torch.float32, seed=1)
    x[0, :128] *= big / x[0, :128].abs().max()
    x[1] = big
    x[2, 5] = -big
    x[3] *= 1e-30 if dtype != torch.float16 else 1e-4
    q, s = check_quantizer(x.to(dtype).to(DEVICE), 128)
    assert q.cpu().float().isfinite().all() and s.isfinite().all()


@pytest.mark.parametrize("dtype", IN_DTYPES)
def test_quantizer_strided_rows_and_empty(dtype):
    wide = random_activations(9, 400, dtype, seed=3).to(DEVICE)
    check_quantizer(wide[::2, 10:310], 128)
    q, s = fp8.quantize_per_token_group(wide[:0], 128)
    assert q.shape == (0, 400) and s.shape == (0, 4)


def test_quantizer_bad_inputs():
    with pytest.raises(ValueError, match="2-d"):
        fp8.quantize_per_token_group(torch.zeros(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="2-d"):
        fp8.quantize_per_token_group(torch.zeros(2, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="unit stride"):
        fp8.quantize_per_token_group(torch.zeros(4, 8, device=DEVICE).t())
    with pytest.raises(ValueError, match="group"):
        fp8.quantize_per_token_group(torch.zeros(4, 8, device=DEVICE), 0)


def within_e4m3(deq: torch.Tensor, x: torch.Tensor, scale: torch.Tensor):
    """Round trip within half an e4m3 ulp: 2^-4 relative among normals, 2^-10 * scale below."""
    err = (deq.double() - x.double()).abs()
    assert (err <= torch.maximum(x.double().abs() * 2.0**-4, scale.double() * 2.0**-10)).all()


def test_round_trips():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen) * torch.logspace(-4, 2, 300)[:, None]
    w_fp8, scale_inv = fp8.quantize_weight_blockwise_ref(w)
    assert w_fp8.dtype == fp8.FP8 and scale_inv.shape == (3, 2) and scale_inv.dtype == torch.float32
    within_e4m3(fp8.dequantize_blockwise_ref(w_fp8, scale_inv), w, expand(scale_inv, 300, 200, (128, 128)))
    w_fp8, scale = fp8.quantize_weight_per_channel_ref(w)
    assert scale.shape == (300,) and scale.dtype == torch.float32
    within_e4m3(w_fp8.double() * scale.double()[:, None], w, scale[:, None].expand(-1, 200))
    x = random_activations(7, 300, torch.float32, seed=2)
    q, s = fp8.quantize_per_token_group(x.to(DEVICE))
    within_e4m3(fp8.dequantize_blockwise_ref(q, s, (1, 128)).cpu(), x, expand(s, 7, 300, (1, 128)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", IN_DTYPES)
@pytest.mark.parametrize("m, k", [(1, 4096), (4096, 4096), (333, 5000), (64, 25600)])
@pytest.mark.parametrize("group", [128, None])  # None: per token
def test_compiled_quantizer_matches_reference_on_cuda(dtype, m, k, group):
    check_quantizer(random_activations(m, k, dtype, seed=k).to("cuda"), group or k)
