"""A mixture-of-experts router's choice, as Hugging Face's Qwen3-MoE and Mixtral blocks make it,
in one kernel: each token's softmax over its expert logits (in fp32, of the logits as stored),
the ``top_k`` largest probabilities in descending order with their expert ids, renormalised to
sum to 1 (in fp32) when asked, the weights then rounded once to the logits' dtype.

Ties (equal probabilities) go to the lower expert id, in the kernel and in the reference alike
(torch's ``topk`` leaves their order unspecified). The kernel's exp, sum and divisions may differ
from torch's in the last bits of fp32, so its weights agree with the reference's to about 1e-6
relative before the rounding, and its ids are the same unless two probabilities lie within that
rounding of each other.

One program per token (per few tokens when there are fewer experts than a warp has lanes), in
one warp: the row of probabilities stays in its registers through the ``top_k`` rounds of (max,
lowest id reaching it, that id masked out), each round's reductions warp shuffles only. Rows
spread over more warps pass every round through shared memory: on an H100, 128 experts top-8
took 6.0 us a launch with 8 tokens over 4 warps, 2.2 us with a token a warp."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import pdl_options, wait_for_prior_grid

MAX_EXPERTS = 1024  # a row per token, held whole
_LANES = 32  # a warp's: a program's columns fill at least these


def _check(logits: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(
            f"logits must be a 2-d floating tensor [tokens, experts]: {logits.dtype} {tuple(logits.shape)}"
        )
    experts = logits.shape[1]
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must lie in [1, {experts}] (the experts): {top_k}")


def route_ref(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [tokens, top_k] in logits.dtype, ids [tokens, top_k] int64)``: each token's
    ``top_k`` largest softmax probabilities (fp32) over ``logits [tokens, experts]``, descending,
    ties to the lower id, renormalised to sum to 1 when ``renormalise``."""
    _check(logits, top_k)
    probs = logits.softmax(dim=-1, dtype=torch.float)
    # a stable descending sort keeps equal probabilities in id order; topk's tie order is unspecified
    weights, ids = probs.sort(dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids.contiguous()


@triton.jit(do_not_specialize=["tokens", "stride_row"])
def _route_kernel(
    logits_ptr, w_ptr, ids_ptr, tokens, experts, top_k, stride_row,
    RENORMALISE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Tokens ``[program_id(0) * BLOCK_T, + BLOCK_T)``: their ``top_k`` weights and ids, stored
    contiguously ``[tokens, top_k]``."""
    wait_for_prior_grid(PDL)
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < tokens
    col_ok = (cols < experts)[None, :]
    ptrs = logits_ptr + rows[:, None] * stride_row + cols[None, :]
    x = tl.load(ptrs, mask=row_ok[:, None] & col_ok, other=0.0)
    # padded columns weigh nothing; rows past the last token load 0s, finite (no -inf - -inf NaN)
    x = tl.where(col_ok, x.to(tl.float32), float("-inf"))
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    # correctly rounded divisions, as torch's: the ranking and the weights stay within its last bits
    p = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None])
    # below any real probability, an underflowed 0 included: padding is never chosen
    p = tl.where(col_ok, p, float("-inf"))
    ks = tl.arange(0, BLOCK_K)
    w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for k in range(top_k):
        best = tl.max(p, axis=1)
        idx = tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), axis=1)
        # a NaN row matches nothing: its ids stay in range, so the expert kernels stay in bounds
        idx = tl.minimum(idx, experts - 1)
        w = tl.where(ks[None, :] == k, best[:, None], w)
        ids = tl.where(ks[None, :] == k, idx[:, None], ids)
        p = tl.where(cols[None, :] == idx[:, None], float("-inf"), p)
    if RENORMALISE:
        w = tl.math.div_rn(w, tl.sum(w, axis=1)[:, None])
    out = rows[:, None] * top_k + ks[None, :]
    out_mask = row_ok[:, None] & (ks < top_k)[None, :]
    tl.store(w_ptr + out, w.to(w_ptr.dtype.element_ty), mask=out_mask)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=out_mask)


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`route_ref` (up to the last bits of fp32 exp and sum): one launch,
    no host sync. ``logits [tokens, experts]`` floating with a unit stride in its last dimension,
    at most :data:`MAX_EXPERTS` experts; outputs contiguous."""
    _check(logits, top_k)
    tokens, experts = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits need a unit stride in the last dimension")
    if experts > MAX_EXPERTS:
        raise ValueError(f"{experts} experts are above the kernel's {MAX_EXPERTS}")
    weights = torch.empty(tokens, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    if tokens:
        block_e = triton.next_power_of_2(experts)
        block_t = max(1, _LANES // block_e)
        _route_kernel[(triton.cdiv(tokens, block_t),)](
            logits, weights, ids, tokens, experts, top_k, logits.stride(0),
            RENORMALISE=renormalise, BLOCK_T=block_t, BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=max(1, block_e // 256),
            **pdl_options(logits.device),
        )  # fmt: skip
    return weights, ids
