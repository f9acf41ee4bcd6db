"""The small-batch GEMM kernel vs ``F.linear`` (interpreter on CPU, device on GPU), and where the
linear layers take it."""

import pytest
import torch

import nanovllm.kernels.small_batch_gemm as small_batch_gemm_module
from nanovllm.kernels.small_batch_gemm import (
    MAX_ROWS,
    small_batch_gemm,
    small_batch_gemm_pays,
    small_batch_gemm_ref,
)
from tests.interpreter import DEVICE, DTYPES

pytestmark = pytest.mark.gpu


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # both sum in float32 (in other orders); the 16-bit results may differ by their last bit
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize(
    "k, n, bias",
    [(1024, 64, False), (640, 48, True), (512, 40, False)],  # K of whole and partial steps; N of part tiles
)
def test_kernel_matches_reference(dtype, rows, k, n, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    got = small_batch_gemm(x, w, b)
    assert got.shape == (rows, n) and got.dtype == dtype
    want = small_batch_gemm_ref(x.double(), w.double(), None if b is None else b.double())
    _close(got, want.to(dtype))


@pytest.mark.parametrize("tile", [(32, 256, 2, 2), (16, 128, 1, 3), (64, 64, 4, 4)])
@pytest.mark.parametrize("swiglu", [False, True])
def test_other_tiles_match_reference(tile, swiglu):
    """The tiles a benchmark may pass: part tiles of N, K steps that do not divide K, 1-4 warps."""
    gen = torch.Generator().manual_seed(tile[0])
    x = torch.randn(5, 640, generator=gen).to(DEVICE)
    w = (torch.randn(2 * 40, 640, generator=gen) / 640**0.5).to(DEVICE)
    got = small_batch_gemm(x, w, swiglu=swiglu, tile=tile)
    _close(got, small_batch_gemm_ref(x.double(), w.double(), swiglu=swiglu).float())


def test_kernel_on_rows_of_a_wider_tensor():
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(4, 2 * 512, generator=gen).to(DEVICE)
    w = torch.randn(32, 512, generator=gen).to(DEVICE) / 512**0.5
    x = wide[:, :512]  # rows 1,024 apart
    _close(small_batch_gemm(x, w), small_batch_gemm_ref(x.double(), w.double()).float())


def test_bad_inputs():
    w = torch.zeros(32, 64, device=DEVICE)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        small_batch_gemm(torch.zeros(MAX_ROWS + 1, 64, device=DEVICE), w)
    with pytest.raises(ValueError, match="expected x"):
        small_batch_gemm(torch.zeros(2, 48, device=DEVICE), w)
    with pytest.raises(ValueError, match="share one of"):
        small_batch_gemm(torch.zeros(2, 64, device=DEVICE, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="contiguous"):
        small_batch_gemm(torch.zeros(2, 64, device=DEVICE), torch.zeros(64, 32, device=DEVICE).t())


def test_taken_only_when_enabled_for_small_16_bit_batches_on_cuda(monkeypatch):
    monkeypatch.setattr(small_batch_gemm_module, "ENABLED", True)
    cpu = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert not small_batch_gemm_pays(cpu, 1 << 20)  # the interpreter is for tests, not speed
    if DEVICE != "cuda":
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.zeros(MAX_ROWS, 64, dtype=torch.bfloat16, device="cuda")
    assert small_batch_gemm_pays(x, 16 * sms)  # 16 weight rows a program, 32 with SwiGLU
    assert not small_batch_gemm_pays(x, 16 * sms - 1)  # some SMs would idle: cuBLAS cuts K instead
    assert small_batch_gemm_pays(x, 32 * sms, swiglu=True)
    assert not small_batch_gemm_pays(x, 32 * sms - 2, swiglu=True)
    too_many = torch.zeros(MAX_ROWS + 1, 64, dtype=torch.bfloat16, device="cuda")
    assert not small_batch_gemm_pays(too_many, 1 << 16)
    assert not small_batch_gemm_pays(x.float(), 1 << 16)
    monkeypatch.setattr(small_batch_gemm_module, "ENABLED", False)
    assert not small_batch_gemm_pays(x, 1 << 16)  # NANOVLLM_SMALL_BATCH_GEMM=0: cuBLAS


@pytest.mark.skipif(DEVICE != "cuda", reason="the 8B's projections at decode sizes, in bf16 on the GPU")
@pytest.mark.parametrize("rows", [1, 7, 16])
@pytest.mark.parametrize(
    "k, n, swiglu",
    [(4096, 6144, False), (4096, 4096, False), (4096, 24576, False), (4096, 24576, True)]
    + [(12288, 4096, False)],  # the 8B's q/k/v, o, gate/up (alone and with SwiGLU), down
)
def test_decoder_projections_on_cuda(rows, k, n, swiglu):
    gen = torch.Generator().manual_seed(k + n)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16).cuda()
    graph = torch.cuda.CUDAGraph()
    small_batch_gemm(x, w, swiglu=swiglu)  # compiled outside the capture
    with torch.cuda.graph(graph):
        got = small_batch_gemm(x, w, swiglu=swiglu)
    graph.replay()
    _close(got, small_batch_gemm_ref(x, w, swiglu=swiglu))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, k", [(1, 512), (5, 640), (MAX_ROWS, 512)])  # K of whole and partial steps
def test_swiglu_epilogue_matches_reference(dtype, rows, k):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    w = (2 * torch.randn(2 * 40, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)  # 40 pairs: a part tile
    got = small_batch_gemm(x, w, swiglu=True)
    assert got.shape == (rows, 40)
    # the same roundings in the same places; the products' sums may differ in their last bit
    _close(got, small_batch_gemm_ref(x, w, swiglu=True))


def test_swiglu_needs_pairs_and_no_bias():
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="even"):
        small_batch_gemm(x, torch.zeros(33, 64, device=DEVICE), swiglu=True)
    with pytest.raises(ValueError, match="no bias"):
        small_batch_gemm(x, torch.zeros(32, 64, device=DEVICE), torch.zeros(32, device=DEVICE), swiglu=True)
