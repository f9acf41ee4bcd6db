"""A linear layer with its neighbours fused in: RMSNorm before it, SwiGLU or a residual add after.

For steps of few rows (decode), where each of those would otherwise be a kernel of its own
that reads and writes the activations once more.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def fused_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch reference, each step rounded to ``x.dtype`` as Hugging Face's layers round it.

    ``x``: ``[rows, K]``; ``weight``: ``[N, K]`` (with ``swiglu``, gate rows then up rows);
    ``norm_weight``: ``[K]``, RMSNorm applied to ``x`` first; ``residual``: ``[rows, N]``,
    added last. Returns ``[rows, N]`` (``[rows, N / 2]`` with ``swiglu``).
    """
    if norm_weight is not None:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
        x = h.to(x.dtype) * norm_weight
    y = F.linear(x, weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = residual + y
    return y


@triton.jit(do_not_specialize=["num_rows"])
def _fused_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    norm_ptr,
    res_ptr,
    out_ptr,
    num_rows,
    N,
    K,
    eps,
    stride_x,
    stride_w,
    stride_res,
    stride_out,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of the output (N output columns; with SWIGLU the up rows of
    ``w`` start N rows after the gate rows)."""
    num_m = tl.cdiv(num_rows, BLOCK_M)
    # row tiles of one weight tile are neighbours in launch order, so the tile is read from
    # memory once and from L2 after
    pid_m = tl.program_id(0) % num_m
    pid_n = tl.program_id(0) // num_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w

    if NORM:  # the rows' RMS first: every tile of a row needs it before its first product
        sum_sq = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = k0 + offs_k < K
            xk = tl.load(x_rows + k0 + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            xk = xk.to(tl.float32)
            sum_sq += tl.sum(xk * xk, 1)
        inv_rms = tl.rsqrt(sum_sq / K + eps)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        xk = tl.load(x_rows + k0 + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:  # normalised, rounded, then scaled and rounded again, as the reference
            g = tl.load(norm_ptr + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            xk = (xk.to(tl.float32) * inv_rms[:, None]).to(dtype)
            xk = (xk.to(tl.float32) * g[None, :]).to(dtype)
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + k0 + offs_k[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(xk, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if SWIGLU:
            w_up = tl.load(w_rows + N * stride_w + k0 + offs_k[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(xk, tl.trans(w_up), acc_up, input_precision=DOT_PRECISION)

    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dtype)
    if SWIGLU:  # silu rounded before the product, as the reference
        gate = y.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        y = (act.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    mask = row_mask[:, None] & col_mask[None, :]
    if RESIDUAL:
        res = tl.load(res_ptr + rows.to(tl.int64)[:, None] * stride_res + cols[None, :], mask=mask)
        y = (res.to(tl.float32) + y.to(tl.float32)).to(dtype)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], y, mask=mask)


def _tiles(num_rows: int, element_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for a step of ``num_rows`` rows."""
    block_m = max(16, min(64, triton.next_power_of_2(num_rows)))
    if element_size == 4:  # fp32 (tests): small tiles keep registers and shared memory in bounds
        return min(block_m, 32), 32, 32, 4, 2
    return block_m, 64, 128, 4, 3


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`fused_linear_ref` (same semantics), one launch.

    ``out`` may be ``residual`` itself (each element is read before it is written). Needs 2-D
    ``x``, ``weight``, ``residual`` and ``out`` with unit stride in the last dimension.
    """
    num_rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features but weight takes {weight.shape[1]}")
    if swiglu:
        if n % 2:
            raise ValueError(f"a SwiGLU weight holds gate and up rows, so it needs an even count, not {n}")
        if bias is not None:
            raise ValueError("SwiGLU with a bias is not supported")
        n //= 2
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"norm_weight must have shape ({k},), got {tuple(norm_weight.shape)}")
    if residual is not None and residual.shape != (num_rows, n):
        raise ValueError(f"residual must have shape ({num_rows}, {n}), got {tuple(residual.shape)}")
    if out is None:
        out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    tensors = [x, weight, out] + ([residual] if residual is not None else [])
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("x, weight, residual and out need a unit stride in the last dimension")
    if num_rows == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = _tiles(num_rows, x.element_size())
    grid = (triton.cdiv(num_rows, block_m) * triton.cdiv(n, block_n),)
    _fused_linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,
        norm_weight if norm_weight is not None else x,
        residual if residual is not None else x,
        out,
        num_rows,
        n,
        k,
        eps,
        x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        HAS_BIAS=bias is not None,
        NORM=norm_weight is not None,
        SWIGLU=swiglu,
        RESIDUAL=residual is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
