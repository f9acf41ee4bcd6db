"""A grammar's token bitmask applied to a batch's logits, in place, for structured outputs.

The layout is xgrammar's: a row of the bitmask is ``int32[ceil(vocab / 32)]`` and token ``t``
is allowed iff bit ``t % 32`` (least significant first) of word ``t // 32`` is set; bit 31 makes
the word negative. Every logit of a disallowed token becomes -inf, so sampling never draws it.
Tokens past the bitmask's last word are disallowed; words past the vocabulary are ignored.

The kernel never reads the logits: one launch over (rows, vocab blocks), each program loads
its block's words, expands them to bits and stores -inf where a bit is clear. On CUDA the
kernel runs, elsewhere the reference (:func:`apply_token_bitmask_dispatch_`).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_BLOCK = 4096  # tokens per program, a multiple of 32
_NUM_WARPS = 4


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Plain-torch reference: in ``logits`` (``[num_rows, vocab]``), row ``rows[i]`` gets -inf
    for every token that ``bitmask[i]`` (``int32[num_words]``) does not allow."""
    vocab = logits.shape[1]
    tokens = torch.arange(vocab, device=logits.device)
    # a zero word after the last one stands for every token past the bitmask
    words = F.pad(bitmask, (0, 1))[:, (tokens // 32).clamp(max=bitmask.shape[1])]
    allowed = (words >> (tokens % 32).to(torch.int32)) & 1
    rows = rows.long()
    logits[rows] = logits[rows].masked_fill(allowed == 0, float("-inf"))


@triton.jit(do_not_specialize=["vocab_size", "num_words", "stride_logits", "stride_mask"])
def _token_bitmask_kernel(
    logits_ptr, mask_ptr, rows_ptr, vocab_size, num_words, stride_logits, stride_mask, BLOCK: tl.constexpr
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    word = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    bits = tl.arange(0, 32)
    w = tl.load(mask_ptr + i.to(tl.int64) * stride_mask + word, mask=word < num_words, other=0)
    # signed shift: bit 31 of a negative word still comes out as 1
    allowed = ((w[:, None] >> bits[None, :]) & 1) != 0
    tokens = word[:, None] * 32 + bits[None, :]
    # made in fp32 and cast: triton 3.8's interpreter has no bf16 constants
    neg_inf = tl.full((BLOCK // 32, 32), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    ptrs = logits_ptr + row * stride_logits + tokens
    tl.store(ptrs, neg_inf, mask=(tokens < vocab_size) & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Triton version of :func:`apply_token_bitmask_ref` (same semantics, no host sync);
    ``logits`` and ``bitmask`` need a unit stride in their last dimension."""
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        raise ValueError("logits and bitmask need a unit stride in the last dimension")
    if bitmask.dtype != torch.int32 or bitmask.shape[0] != rows.shape[0]:
        raise ValueError(
            f"bitmask must be int32 with one row per entry of rows: {bitmask.dtype}, {bitmask.shape}"
        )
    vocab_size = logits.shape[1]
    if not rows.shape[0] or not vocab_size:
        return
    grid = (rows.shape[0], triton.cdiv(vocab_size, _BLOCK))
    _token_bitmask_kernel[grid](
        logits,
        bitmask,
        rows.contiguous(),
        vocab_size,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
        BLOCK=_BLOCK,
        num_warps=_NUM_WARPS,
    )


def apply_token_bitmask_dispatch_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """:func:`apply_token_bitmask_` on CUDA, :func:`apply_token_bitmask_ref` elsewhere."""
    (apply_token_bitmask_ if logits.is_cuda else apply_token_bitmask_ref)(logits, bitmask, rows)
