"""Flash-decoding's second kernel: it combines the partial outputs of a context's splits
(:mod:`decode_attention` cuts and attends them)."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import pdl_options, wait_for_prior_grid

_REDUCE_CHUNK = 64  # splits combined per reduce step (bounds its registers)
_REDUCE_BLOCK_D = 32  # head dims per reduce program: more programs, each with a short chain


def combine_splits_ref(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """Plain-torch reference of :func:`combine_splits` (same arguments)."""
    weights = torch.exp2(lse - lse.amax(dim=-1, keepdim=True))
    weights = weights / weights.sum(dim=-1, keepdim=True)
    out.copy_((part * weights[..., None]).sum(dim=2))


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    num_heads,
    num_splits,
    stride_ob,
    stride_oh,
    BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Combine the per-split partial outputs of one (sequence, query head), BLOCK_D dims."""
    wait_for_prior_grid(PDL)
    head = tl.program_id(0)
    seq = tl.program_id(1)
    row0 = (seq * num_heads + head) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(lse_ptr + row0 + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    # Split 0 always holds tokens (context_len >= 1), so the max is finite.
    m = tl.max(lse, 0)
    denom = tl.sum(tl.exp2(lse - m), 0)
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    # Partials go through in chunks: one [num_splits, BLOCK_D] tile would spill registers.
    for chunk in range(0, num_splits, CHUNK):
        c_mask = chunk + offs_c < num_splits
        rows = row0 + chunk + offs_c
        w = tl.exp2(tl.load(lse_ptr + rows, mask=c_mask, other=float("-inf")) - m)
        part = tl.load(part_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=c_mask[:, None])
        acc += tl.sum(part * w[:, None], 0)
    out = (acc / denom).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out)


def combine_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """``out[b, h] = sum_s softmax_s(lse[b, h, :]) * part[b, h, s]``; part is fp32 ``[batch,
    heads, splits, head_dim]``, lse the base-2 log-sum-exp of each split (-inf: empty)."""
    batch, num_heads, num_splits, head_dim = part.shape
    block_d = min(head_dim, _REDUCE_BLOCK_D)
    _decode_reduce_kernel[(num_heads, batch, head_dim // block_d)](
        part,
        lse,
        out,
        num_heads,
        num_splits,
        *out.stride()[:2],
        BLOCK_S=triton.next_power_of_2(num_splits),
        CHUNK=min(_REDUCE_CHUNK, triton.next_power_of_2(num_splits)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        **pdl_options(part.device),
    )
