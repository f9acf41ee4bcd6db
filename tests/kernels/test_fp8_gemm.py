"""The FP8 GEMM vs its torch references (interpreter on CPU, compiled on CUDA), and the references
vs float64 arithmetic on the same quantized values."""

import pytest
import torch

from nanovllm.kernels import fp8
from nanovllm.kernels import fp8_gemm as gemm
from tests.interpreter import DEVICE
from tests.kernels.fp8_inputs import expand, random_activations

# The GEMM's tolerance relative to the sum of absolute terms: tight under the interpreter, looser on
# CUDA, where Hopper's fp8 tensor cores sum each K step in reduced precision (about 14 bits) before
# the fp32 accumulation (the tests below run there too when a GPU is present).
GPU_GEMM_REL = 5e-3
REL = 1e-5 if DEVICE == "cpu" else GPU_GEMM_REL


def exact_product(a_fp8, a_scales, a_block, w_fp8, w_scales, w_block):
    """``(a @ w.T, |a| @ |w|.T)`` of the dequantized operands in float64: the product, and the sums
    of absolute terms that bound its rounding errors."""
    (m, k), n = a_fp8.shape, w_fp8.shape[0]
    a = a_fp8.cpu().double() * expand(a_scales, m, k, a_block)
    w = w_fp8.cpu().double() * expand(w_scales, n, k, w_block)
    return a @ w.T, a.abs() @ w.abs().T


@pytest.mark.parametrize("m, n, k", [(1, 128, 128), (16, 200, 320), (65, 384, 256)])
def test_references_against_float64(m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    a_fp8, a_scales = fp8.quantize_per_token_group_ref(torch.randn(m, k, generator=gen) * 3)
    w_fp8, w_scale_inv = fp8.quantize_weight_blockwise_ref(torch.randn(n, k, generator=gen) * 0.02)
    exact, bound = exact_product(a_fp8, a_scales, (1, 128), w_fp8, w_scale_inv, (128, 128))
    ref = gemm.fp8_block_gemm_ref(a_fp8, a_scales, w_fp8, w_scale_inv, torch.float32)
    assert ref.shape == (m, n) and ((ref.double() - exact).abs() <= 1e-5 * bound).all()
    a_tok, a_scale = fp8.quantize_per_token_group_ref(torch.randn(m, k, generator=gen), k)
    w_ch, w_scale = fp8.quantize_weight_per_channel_ref(torch.randn(n, k, generator=gen))
    exact, bound = exact_product(a_tok, a_scale, (1, k), w_ch, w_scale[:, None], (1, k))
    for scale in (a_scale, a_scale.view(-1)):
        ref = gemm.fp8_channel_gemm_ref(a_tok, scale, w_ch, w_scale, torch.float32)
        assert ((ref.double() - exact).abs() <= 1e-5 * bound).all()
    assert gemm.fp8_channel_gemm_ref(a_tok, a_scale, w_ch, w_scale, torch.bfloat16).dtype == torch.bfloat16


def gemm_operands(m, n, k, seed, device):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, k)
    w = torch.randn(n, k, generator=gen) * 0.05 * torch.logspace(-1, 1, n)[:, None]
    a_fp8, a_scales = fp8.quantize_per_token_group_ref(x)
    w_fp8, w_scale_inv = fp8.quantize_weight_blockwise_ref(w)
    return [t.to(device) for t in (a_fp8, a_scales, w_fp8, w_scale_inv)]


def channel_operands(m, n, k, seed, device):
    """Per-token activations, per-channel weights: ``quantization="fp8"``'s layout."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, m)[:, None]
    w = torch.randn(n, k, generator=gen) * 0.05 * torch.logspace(-1, 1, n)[:, None]
    a_fp8, a_scale = fp8.quantize_per_token_group_ref(x, group=k)
    w_fp8, w_scale = fp8.quantize_weight_per_channel_ref(w)
    return [t.to(device) for t in (a_fp8, a_scale, w_fp8, w_scale)]


def check_channel_gemm(args, out_dtype, rel, products=None):
    """The per-token x per-channel product vs its reference (as :func:`check_gemm`); ``products``:
    outputs to check, by default ``fp8_gemm``'s with the weight scales as ``[N]`` and ``[N, 1]``."""
    a_fp8, a_scale, w_fp8, w_scale = args
    ref32 = gemm.fp8_channel_gemm_ref(*args, torch.float32).cpu().double()
    bound = (a_fp8.cpu().double().abs() @ w_fp8.cpu().double().abs().T) * a_scale.cpu().double()
    bound = bound * w_scale.cpu().double()[None, :]
    ref = ref32.to(out_dtype).double()
    tol = rel * bound
    if out_dtype != torch.float32:
        tol = tol + torch.finfo(out_dtype).eps * torch.exp2(torch.frexp(ref32).exponent.double() - 1)
    if products is None:
        products = [gemm.fp8_gemm(a_fp8, a_scale, w_fp8, s, out_dtype) for s in (w_scale, w_scale[:, None])]
    for out in products:
        assert out.dtype == out_dtype and out.shape == ref.shape
        err = (out.cpu().double() - ref).abs()
        assert (err <= tol).all(), f"max error {err.max().item():.3g}"


def check_gemm(args, out_dtype, rel, config=None, got=None):
    """Kernel (or ``got``) vs reference, errors bounded relative to the sum of absolute terms; a
    16-bit output also within one ulp of the fp32 reference rounded to it (the interpreter
    truncates to bf16)."""
    out = gemm.fp8_gemm(*args, out_dtype, config=config) if got is None else got
    ref32 = gemm.fp8_block_gemm_ref(*args, torch.float32)
    assert out.dtype == out_dtype and out.shape == ref32.shape
    assert torch.equal(gemm.fp8_block_gemm_ref(*args, out_dtype), ref32.to(out_dtype))
    a = fp8.dequantize_blockwise_ref(args[0], args[1], (1, 128)).abs()
    bound = (a @ fp8.dequantize_blockwise_ref(args[2], args[3]).abs().T).cpu().double()
    out, ref = out.cpu().double(), ref32.cpu().to(out_dtype).double()
    tol = rel * bound
    if out_dtype != torch.float32:
        exponent = torch.frexp(ref32.cpu().double()).exponent - 1
        tol = tol + torch.finfo(out_dtype).eps * torch.exp2(exponent.double())
    err = (out - ref).abs()
    assert (err <= tol).all(), (
        f"max error {err.max().item():.3g}, relative to |a||w| {(err / bound).max():.3g}"
    )


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 16, 65])
@pytest.mark.parametrize("n", [128, 200, 384])
@pytest.mark.parametrize("k", [128, 256, 320])
def test_block_gemm_matches_reference(out_dtype, m, n, k):
    check_gemm(gemm_operands(m, n, k, m * n + k, DEVICE), out_dtype, REL)


@pytest.mark.parametrize(
    "m, n, k", [(1, 128, 128), (16, 200, 320), (65, 384, 256), (3, 48, 100), (2, 96, 2048)]
)  # the last: few programs, so the default tiles cut K in two
def test_channel_gemm_matches_reference(m, n, k):
    check_channel_gemm(channel_operands(m, n, k, m + n + k, DEVICE), torch.float32, REL)


@pytest.mark.parametrize("block_k", [256, 512])
def test_channel_gemm_takes_k_steps_wider_than_a_scale_group(block_k):
    """Per-channel scales do not change along K, so a K step may span several 128-feature groups
    (the mid-sized batches' tiles); with block scales it may not."""
    args = channel_operands(40, 96, 700, 3, DEVICE)
    config = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=block_k, GROUP_M=2)
    got = gemm.fp8_gemm(*args, torch.float32, config=config)
    check_channel_gemm(args, torch.float32, REL, products=[got])
    with pytest.raises(ValueError, match="BLOCK_K"):
        gemm.fp8_gemm(*args, torch.float32, config=dict(BLOCK_K=96))


@pytest.mark.parametrize("m, k, block_m", [(5, 704, 16), (40, 2048, 32)])
@pytest.mark.parametrize("split", [1, 2, 3])
def test_per_channel_tiles_with_k_whole_or_in_shares(m, k, block_m, split):
    """The per-channel product with zeros past the edges, K whole or cut into shares."""
    args = channel_operands(m, 96, k, m + k, DEVICE)
    config = dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=128, GROUP_M=2, SPLIT_K=split)
    got = gemm.fp8_gemm(*args, torch.bfloat16, config=config)
    check_channel_gemm(args, torch.bfloat16, REL, products=[got])


@pytest.mark.parametrize("split", [2, 3, 8])
def test_split_k_gives_the_product(split):
    """K cut into shares (each a multiple of BLOCK_K, the last shorter or empty), their fp32 sums
    added by a second kernel, scaled there (per channel) or per group as they are summed (blocks);
    the same output on every run."""
    channel = channel_operands(5, 96, 700, 4, DEVICE)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=split)
    got = gemm.fp8_gemm(*channel, torch.bfloat16, config=config)
    check_channel_gemm(channel, torch.bfloat16, REL, products=[got])
    assert torch.equal(got, gemm.fp8_gemm(*channel, torch.bfloat16, config=config))
    check_gemm(gemm_operands(5, 200, 320, 8, DEVICE), torch.float32, REL, config)
    with pytest.raises(ValueError, match="SPLIT_K"):
        gemm.fp8_gemm(*channel, torch.float32, config=dict(SPLIT_K=0))


def test_block_scales_kept_per_row_give_the_block_product():
    """The engine's layout of an FP8 checkpoint's scales: each 128 x 128 block's scale repeated
    on every row of the block (so that rows can be split across ranks)."""
    a_fp8, a_scales, w_fp8, w_scale_inv = gemm_operands(9, 300, 256, 11, DEVICE)
    per_row = w_scale_inv.repeat_interleave(128, dim=0)[:300]
    out = gemm.fp8_gemm(a_fp8, a_scales, w_fp8, per_row, torch.float32)
    assert torch.equal(out, gemm.fp8_gemm(a_fp8, a_scales, w_fp8, w_scale_inv, torch.float32))
    check_gemm([a_fp8, a_scales, w_fp8, w_scale_inv], torch.float32, REL)


@pytest.mark.parametrize(
    "config",
    [
        dict(BLOCK_M=32, BLOCK_N=256, BLOCK_K=64, GROUP_M=2),  # a column tile over two weight blocks
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, GROUP_M=4),
        dict(BLOCK_M=128, BLOCK_N=16, BLOCK_K=128, GROUP_M=1),
    ],
)
def test_block_gemm_other_tiles_and_strides(config):
    a_fp8, a_scales, w_fp8, w_scale_inv = gemm_operands(70, 300, 330, 7, DEVICE)
    wide = torch.zeros(70, 400, dtype=torch.uint8, device=DEVICE)
    wide[:, 5:335] = a_fp8.view(torch.uint8)
    a_strided = wide.view(fp8.FP8)[:, 5:335]  # a row stride of 400
    a_scales_t = a_scales.t().contiguous().t()  # column-major scales
    check_gemm([a_strided, a_scales_t, w_fp8, w_scale_inv], torch.float32, REL, config)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_block_gemm_16bit_outputs_and_quantized_activations(out_dtype):
    x = random_activations(9, 256, out_dtype, seed=4).to(DEVICE)
    a_fp8, a_scales = fp8.quantize_per_token_group(x)
    w_fp8, w_scale_inv = gemm_operands(1, 130, 256, 5, DEVICE)[2:]
    check_gemm([a_fp8, a_scales, w_fp8, w_scale_inv], out_dtype, REL)


def test_block_gemm_empty_and_bad_inputs():
    a_fp8, a_scales, w_fp8, w_scale_inv = gemm_operands(3, 130, 200, 6, DEVICE)
    assert gemm.fp8_gemm(a_fp8[:0], a_scales[:0], w_fp8, w_scale_inv, torch.bfloat16).shape == (0, 130)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gemm.fp8_gemm(a_fp8.float(), a_scales, w_fp8, w_scale_inv, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        gemm.fp8_gemm(a_fp8, a_scales, w_fp8[:, :128], w_scale_inv, torch.float32)
    with pytest.raises(ValueError, match="scales"):
        gemm.fp8_gemm(a_fp8, a_scales[:2], w_fp8, w_scale_inv, torch.float32)
    with pytest.raises(ValueError, match="scales"):
        gemm.fp8_gemm(a_fp8, a_scales, w_fp8, w_scale_inv[:, :1].repeat(1, 3), torch.float32)
    with pytest.raises(ValueError, match="float32"):
        gemm.fp8_gemm(a_fp8, a_scales.half(), w_fp8, w_scale_inv, torch.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        gemm.fp8_gemm(a_fp8, a_scales, w_fp8, w_scale_inv, torch.int32)
    with pytest.raises(ValueError, match="BLOCK_K"):
        gemm.fp8_gemm(a_fp8, a_scales, w_fp8, w_scale_inv, torch.float32, config=dict(BLOCK_K=256))


# The compiled kernels and the layers on CUDA.


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 8, 16, 64, 200, 1024, 4096])
@pytest.mark.parametrize("n, k", [(4096, 4096), (6144, 4096), (4096, 12288), (1000, 1100)])
def test_compiled_block_gemm_matches_reference_on_cuda(out_dtype, m, n, k):
    check_gemm(gemm_operands(m, n, k, m + n + k, "cuda"), out_dtype, GPU_GEMM_REL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 16, 64, 128, 256, 1024])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 12288), (1000, 1104)])
def test_compiled_channel_gemm_matches_reference_on_cuda(out_dtype, m, n, k):
    check_channel_gemm(channel_operands(m, n, k, m + n + k, "cuda"), out_dtype, GPU_GEMM_REL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "config",
    [
        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=4, SPLIT_K=1),
        dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=3, SPLIT_K=4),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, num_warps=4, num_stages=3, SPLIT_K=2),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3, SPLIT_K=3),
    ],
)
@pytest.mark.parametrize("m, n, k", [(1, 4096, 12288), (48, 6144, 4096), (200, 1000, 1104)])
def test_compiled_channel_gemm_tiles_and_split_k_on_cuda(config, m, n, k):
    args = channel_operands(m, n, k, m + n + k, "cuda")
    got = gemm.fp8_gemm(*args, torch.bfloat16, config=config)
    check_channel_gemm(args, torch.bfloat16, GPU_GEMM_REL, products=[got])
    assert torch.equal(got, gemm.fp8_gemm(*args, torch.bfloat16, config=config))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 32, 128, 129, 512])
def test_fp8_layer_on_cuda_matches_reference(m):
    """The FP8 layer's CUDA path (quantizer, then the Triton GEMM below ``CUBLAS_MIN_ROWS`` rows
    and cuBLAS's row-wise scaled GEMM from there) against the references."""
    from nanovllm.layers.fp8 import fp8_linear

    gen = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 4096, generator=gen) * torch.logspace(-1, 1, m)[:, None]).to("cuda", torch.bfloat16)
    w_fp8, w_scale = [
        t.cuda() for t in fp8.quantize_weight_per_channel_ref(torch.randn(6144, 4096, generator=gen))
    ]
    a_fp8, a_scale = fp8.quantize_per_token_group_ref(x, group=4096)
    got = fp8_linear(x, w_fp8, w_scale, None)
    check_channel_gemm([a_fp8, a_scale, w_fp8, w_scale], torch.bfloat16, GPU_GEMM_REL, products=[got])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 64, 127, 128, 130, 512, 1001])
@pytest.mark.parametrize(
    "n, k",
    [(6144, 4096), (512, 128), (512, 384), (512, 512), (128, 256)],
    ids=["8b-qkv", "one-group", "three-groups", "four-groups", "one-block"],
)
def test_fp8_block_layer_on_cuda_matches_reference(m, n, k):
    """The block-scaled layer's CUDA path (the Triton GEMM below ``CUBLAS_BLOCK_MIN_ROWS`` rows,
    cuBLAS's block-scaled product from there, rows padded to a multiple of 4, unless the groups
    are not) against the reference, with the scales per block and per row: at the 8B's q/k/v and
    at a small model's sizes (K one to four scale groups; N one block of rows)."""
    from nanovllm.layers.fp8 import block_scales_per_row, fp8_block_linear

    gen = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-1, 1, m)[:, None]).to("cuda", torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * 0.05
    w_fp8, w_scale_inv = [t.cuda() for t in fp8.quantize_weight_blockwise_ref(w)]
    a_fp8, a_scales = fp8.quantize_per_token_group_ref(x)
    for scales in (w_scale_inv, block_scales_per_row(w_scale_inv, n)):
        got = fp8_block_linear(x, w_fp8, scales, None)
        check_gemm([a_fp8, a_scales, w_fp8, w_scale_inv], torch.bfloat16, GPU_GEMM_REL, got=got)
