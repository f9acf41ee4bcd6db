"""SwiGLU's ``silu(gate) * up`` on a fused gate/up projection whose gate and up columns are
interleaved (gate ``j`` at ``2j``, up ``j`` at ``2j + 1``, as the engine stores the weight), one
pass over memory."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_BLOCK = 1024  # output columns per program
_NUM_WARPS = 4


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """``x``: ``[tokens, 2 * size]``, gate and up interleaved. Returns ``[tokens, size]``:
    silu(gate) * up, each of the two ops rounded to ``x.dtype`` as Hugging Face's MLP rounds
    them."""
    return F.silu(x[..., 0::2]) * x[..., 1::2]


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, size, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    # one [BLOCK, 2] load of (gate, up) pairs
    pairs = tl.load(x_ptr + row * stride_x + 2 * cols[:, None] + tl.arange(0, 2)[None, :], mask=mask[:, None])
    gate, up = tl.split(pairs.to(tl.float32))
    # silu rounded to the activation dtype before the product, as the reference does
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`silu_and_mul_ref` (same semantics); ``x`` needs unit stride in
    its last dimension."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension holds gate and up, so it must be even: {x.shape[-1]}")
    if x.stride(-1) != 1:
        raise ValueError("x needs a unit stride in the last dimension")
    size = x.shape[-1] // 2
    x2d = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2d.shape[0], size, dtype=x.dtype, device=x.device)
    if out.numel():
        grid = (x2d.shape[0], triton.cdiv(size, _BLOCK))
        _silu_and_mul_kernel[grid](
            x2d, out, size, x2d.stride(0), out.stride(0), BLOCK=_BLOCK, num_warps=_NUM_WARPS
        )
    return out.view(*x.shape[:-1], size)
