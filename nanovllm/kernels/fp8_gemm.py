"""The FP8 product ``a [M, K] x w [N, K]^T`` in the layouts of ``kernels/fp8.py``: plain-torch
references (float64 where e4m3 products and their sums are exact), and a Triton GEMM on fp8
tensor cores with fp32 sums. With block scales it walks K one scale group at a time: an fp8
``tl.dot`` per group, times the group's activation and weight scales, summed in fp32; with
per-channel scales (``torch._scaled_mm``'s row-wise product, :func:`fp8_channel_gemm_ref`) the
scales apply once to the sum. Decode-sized ``M`` may cut K into shares (split-K).
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import capability, pdl_options, wait_for_prior_grid
from nanovllm.kernels.fp8 import FP8, GROUP, OUT_DTYPES, dequantize_blockwise_ref

_SUM_BLOCK = 1024  # output columns per program adding split-K shares
_SPLIT_PROGRAMS = 192  # programs a decode-sized GEMM wants: ~1.5 waves of Hopper's 132 SMs
_MIN_SHARE = 1024  # features per split-K share at least


def fp8_block_gemm_ref(
    a_fp8: torch.Tensor,
    a_scales: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Plain-torch reference: ``a [M, K]`` scaled per token and 128 features (``a_scales
    [M, ceil(K / 128)]``) times ``w [N, K]`` scaled per 128 x 128 block (``w_scale_inv
    [ceil(N / 128), ceil(K / 128)]``), transposed: ``[M, N]``, both dequantized to fp32, one fp32
    matmul, rounded once to ``out_dtype``."""
    a = dequantize_blockwise_ref(a_fp8, a_scales, (1, GROUP))
    w = dequantize_blockwise_ref(w_fp8, w_scale_inv, (GROUP, GROUP))
    return (a @ w.T).to(out_dtype)


def fp8_row_group_gemm_ref(
    a_fp8: torch.Tensor,
    a_scales: torch.Tensor,
    w_fp8: torch.Tensor,
    w_row_scales: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Reference of the block-scaled product with the weight's scales kept per row (as the
    ``"fp8_block"`` layers and experts keep them): ``a [M, K]`` scaled per token and 128 features
    (``a_scales [M, G]``) times ``w [N, K]`` scaled per row and 128 features (``w_row_scales
    [N, G]``), transposed: ``[M, N]``, both dequantized in float64 (e4m3 values times float32
    scales are exact there), one matmul, rounded once to ``out_dtype`` (the CPU layers' product)."""
    k = a_fp8.shape[-1]
    a = a_fp8.double() * a_scales.double().repeat_interleave(GROUP, dim=1)[:, :k]
    w = w_fp8.double() * w_row_scales.double().repeat_interleave(GROUP, dim=1)[:, :k]
    return (a @ w.T).to(out_dtype)


def fp8_channel_gemm_ref(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Reference of the per-token x per-channel product (``torch._scaled_mm`` with row-wise
    scales): ``(a_fp8 @ w_fp8.T)`` times ``a_scale [M]`` (or ``[M, 1]``) down the rows and
    ``w_scale [N]`` along the columns (or one scale), in float64, rounded once to ``out_dtype``.
    Products of e4m3 values and their sums over up to 2^17 features are exact in float64, so the
    result does not depend on how a matrix library orders the sums (the CPU layers' product)."""
    acc = a_fp8.double() @ w_fp8.double().T
    return (acc * a_scale.double().reshape(-1, 1) * w_scale.double().reshape(1, -1)).to(out_dtype)


@triton.jit
def _tile_origin(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(first row, first column)`` of program ``program_id(0)``'s output tile: tiles launched
    ``GROUP_M`` row tiles per column tile, so neighbouring programs share weight tiles in L2."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    pid, per_group = tl.program_id(0), GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, K_SHARE,
    stride_am, stride_asm, stride_ask, stride_wn, stride_wsn, stride_wsk, stride_om,
    SCALE_GROUP: tl.constexpr, W_ROWS_PER_SCALE: tl.constexpr, GROUP_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` output tile over features ``K_SHARE * program_id(1) ...`` (all
    of K unless ``SPLIT_K``). ``GROUP_SCALES``: the scales change along K (a scale stride of 0
    repeats one), applied to each group's partial product; otherwise one scale per row and per
    column, applied once to the sum."""
    wait_for_prior_grid(PDL)
    first_m, first_n = _tile_origin(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_start = tl.program_id(1) * K_SHARE
    k_end = min(K, k_start + K_SHARE)
    m = first_m + tl.arange(0, BLOCK_M)
    n = first_n + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = m < M, n < N
    a_ptrs = a_ptr + m.to(tl.int64)[:, None] * stride_am + (k_start + k)[None, :]
    w_ptrs = w_ptr + n.to(tl.int64)[:, None] * stride_wn + (k_start + k)[None, :]
    as_ptrs = as_ptr + m * stride_asm
    ws_ptrs = ws_ptr + (n // W_ROWS_PER_SCALE) * stride_wsn  # a column tile may span two blocks
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = k[None, :] < k_end - k0  # past the share: zeros, which add nothing
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok, other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok, other=0.0)
        if GROUP_SCALES:
            g = k0 // SCALE_GROUP  # BLOCK_K divides the group: one scale per row / column per step
            a_s = tl.load(as_ptrs + g * stride_ask, mask=m_ok, other=0.0)
            w_s = tl.load(ws_ptrs + g * stride_wsk, mask=n_ok, other=0.0)
            acc += tl.dot(a, w.T) * a_s[:, None] * w_s[None, :]
        else:  # a fresh dot per step: Hopper's fp8 MMA accumulates in reduced precision (~14 bits)
            acc += tl.dot(a, w.T)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:  # the share's unscaled sum, for _sum_shares_kernel
        rows = tl.program_id(1).to(tl.int64) * M + m  # of the [SPLIT_K * M, N] shares
        tl.store(out_ptr + rows[:, None] * N + n[None, :], acc, mask=mask)
    else:
        if not GROUP_SCALES:
            a_s = tl.load(as_ptrs, mask=m_ok, other=0.0)
            acc = acc * a_s[:, None] * tl.load(ws_ptrs, mask=n_ok, other=0.0)[None, :]
        out_ptrs = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _sum_shares_kernel(
    part_ptr, as_ptr, ws_ptr, out_ptr, M, N, stride_asm, stride_wsn, stride_om,
    W_ROWS_PER_SCALE: tl.constexpr, GROUP_SCALES: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Row ``program_id(0)``, columns ``BLOCK_N * program_id(1) ...`` of a split-K product: the
    shares' sums added in order (the same result on every run), scaled unless they are already."""
    wait_for_prior_grid(PDL)
    m = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for share in range(SPLIT_K):
        acc += tl.load(part_ptr + (share * M + m) * N + n, mask=n_ok, other=0.0)
    if not GROUP_SCALES:
        w_s = tl.load(ws_ptr + (n // W_ROWS_PER_SCALE) * stride_wsn, mask=n_ok, other=0.0)
        acc = acc * tl.load(as_ptr + m * stride_asm) * w_s
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def fp8_gemm_config(m: int, n: int, k: int, group_scales: bool) -> dict:
    """Tiles for ``[m, k] x [n, k]^T`` (``benchmarks/bench_fp8.py --sweep`` on Hopper): decode-sized
    ``m`` takes thin tiles with 256 features a step (128 where the scales change per group), and K
    is cut into shares until enough programs stream the weight; larger ``m`` squarer tiles."""
    step = 128 if group_scales else 256
    wide = n >= 16384  # gate/up: enough column tiles for every SM as it is
    if m <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=64 if wide else 32, BLOCK_K=step, GROUP_M=1, num_warps=4)
        cfg["num_stages"] = 3 if wide else 4
    elif m <= 128:
        step = 128 if wide else step
        cfg = dict(
            BLOCK_M=64, BLOCK_N=64, BLOCK_K=step, GROUP_M=8, num_warps=4, num_stages=4 if step == 128 else 3
        )
    elif m <= 256:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3, SPLIT_K=1)
    else:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3, SPLIT_K=1)
    programs = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    split = 1
    while programs * split < _SPLIT_PROGRAMS and k >= 2 * split * _MIN_SHARE:
        split *= 2
    return cfg | dict(SPLIT_K=split)


def _weight_scale_layout(w_scales: torch.Tensor, n: int, groups: int) -> tuple[int, int, int] | None:
    """``(rows per scale, row stride, group stride)`` of the weight scales, or None if their shape
    is none of the layouts."""
    if w_scales.dim() == 1:
        w_scales = w_scales[:, None]
    if w_scales.dim() != 2 or w_scales.shape[1] not in (1, groups):
        return None
    group_stride = w_scales.stride(1) if w_scales.shape[1] > 1 else 0
    if w_scales.shape[0] == n:
        return 1, w_scales.stride(0), group_stride
    if w_scales.shape[0] == triton.cdiv(n, GROUP):
        return GROUP, w_scales.stride(0), group_stride
    return None


def fp8_gemm(
    a_fp8: torch.Tensor,
    a_scales: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scales: torch.Tensor,
    out_dtype: torch.dtype,
    config: dict | None = None,
) -> torch.Tensor:
    """``a [M, K]`` times ``w [N, K]`` transposed, both dequantized, fp32 sums, in ``out_dtype``.

    Scale layouts (G = ceil(K / 128)): ``a_scales`` ``[M, G]`` per token and group of 128 features
    or ``[M, 1]`` per token; ``w_scales`` ``[ceil(N / 128), G]`` per 128 x 128 block (as
    :func:`fp8_block_gemm_ref`), ``[N, G]`` per row and group (blocks repeated per row, as the
    engine keeps them), or ``[N]`` / ``[N, 1]`` per output channel (as :func:`fp8_channel_gemm_ref`).
    ``a_fp8`` and ``w_fp8`` need a unit stride in their last dimension; the scales may have any
    strides. ``config`` overrides :func:`fp8_gemm_config`'s tiles: ``BLOCK_M``, ``BLOCK_N``
    (powers of two >= 16), ``BLOCK_K`` (a power of two >= 32, dividing 128 where the scales change
    along K), ``GROUP_M``, ``num_warps``, ``num_stages``, ``SPLIT_K`` (K cut into that many shares,
    each a program's, their fp32 sums added by a second kernel: more programs to stream a weight at
    decode-sized ``m``).
    On CUDA it needs float8 tensor cores (sm_89+)."""
    if a_fp8.dtype != FP8 or w_fp8.dtype != FP8:
        raise ValueError(f"a_fp8 and w_fp8 must be float8_e4m3fn: {a_fp8.dtype}, {w_fp8.dtype}")
    if a_fp8.dim() != 2 or w_fp8.dim() != 2 or a_fp8.shape[1] != w_fp8.shape[1]:
        raise ValueError(f"a [M, K] and w [N, K] do not fit: {tuple(a_fp8.shape)}, {tuple(w_fp8.shape)}")
    (m, k), n = a_fp8.shape, w_fp8.shape[0]
    groups = triton.cdiv(k, GROUP)
    w_layout = _weight_scale_layout(w_scales, n, groups)
    a_fits = a_scales.dim() == 2 and a_scales.shape[0] == m and a_scales.shape[1] in (1, groups)
    if not a_fits or w_layout is None:
        raise ValueError(
            f"scales {tuple(a_scales.shape)} / {tuple(w_scales.shape)} must be [{m}, {groups} or 1] / "
            f"[{triton.cdiv(n, GROUP)} or {n}, {groups}] or [{n}]"
        )
    if a_scales.dtype != torch.float32 or w_scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32: {a_scales.dtype}, {w_scales.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be bf16, fp16 or fp32: {out_dtype}")
    if a_fp8.stride(-1) != 1 or w_fp8.stride(-1) != 1:
        raise ValueError("a_fp8 and w_fp8 need a unit stride in the last dimension")
    if a_fp8.is_cuda and capability(a_fp8.device) < (8, 9):
        raise ValueError("fp8_gemm needs float8 tensor cores (compute capability 8.9+)")
    a_group_stride = a_scales.stride(1) if a_scales.shape[1] > 1 else 0
    rows_per_scale, w_row_stride, w_group_stride = w_layout
    group_scales = groups > 1 and (a_group_stride != 0 or w_group_stride != 0)
    cfg = fp8_gemm_config(m, n, k, group_scales) | (config or {})
    block_k = cfg["BLOCK_K"]
    if block_k < 32 or block_k & (block_k - 1) or (group_scales and GROUP % block_k):
        raise ValueError(f"BLOCK_K must be a power of two >= 32 (dividing {GROUP} with groups): {block_k}")
    if not isinstance(cfg.get("SPLIT_K", 1), int) or cfg.get("SPLIT_K", 1) < 1:
        raise ValueError(f"SPLIT_K must be a positive integer: {cfg['SPLIT_K']}")
    out = torch.empty(m, n, dtype=out_dtype, device=a_fp8.device)
    if not m or not n:
        return out
    if not k:
        return out.zero_()
    split = cfg.setdefault("SPLIT_K", 1)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=out.device)
    k_share = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split)
    _fp8_gemm_kernel[grid](
        a_fp8, a_scales, w_fp8, w_scales, target, m, n, k, k_share,
        a_fp8.stride(0), a_scales.stride(0), a_group_stride, w_fp8.stride(0),
        w_row_stride, w_group_stride, out.stride(0),
        SCALE_GROUP=GROUP, W_ROWS_PER_SCALE=rows_per_scale, GROUP_SCALES=group_scales, **cfg,
        **pdl_options(a_fp8.device),
    )  # fmt: skip
    if split > 1:
        _sum_shares_kernel[(m, triton.cdiv(n, _SUM_BLOCK))](
            target, a_scales, w_scales, out, m, n, a_scales.stride(0), w_row_stride, out.stride(0),
            W_ROWS_PER_SCALE=rows_per_scale, GROUP_SCALES=group_scales, SPLIT_K=split, BLOCK_N=_SUM_BLOCK,
            **pdl_options(target.device),
        )  # fmt: skip
    return out
