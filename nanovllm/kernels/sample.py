"""Drawing one token per row of logits by inverse transform sampling, in one kernel.

For row ``r`` with temperature ``T`` and a uniform ``u`` in [0, 1): the token is the first
index whose cumulative ``softmax(logits / T)`` exceeds ``u``; ``T == 0`` means argmax.
The kernel reads the logits twice (normaliser, then the cumulative sum) and writes one int
per row, where sorting or Gumbel noise would write and read vocabulary-sized tensors.

A seeded row (``steps[r] >= 0``) takes its uniform from a hash of ``(seeds[r], steps[r])``
instead, so its draw depends on nothing else in the batch: murmur3's 32-bit finaliser
applied in turn to the step, the seed's high and its low word.
"""

import torch
import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)
_BLOCK_V = 4096
_NUM_WARPS = 8
_MASK32 = 0xFFFF_FFFF
_STEP_SALT = tl.constexpr(0x9E3779B9)


def _mul32_ref(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` < 2**32, in halves so that no product overflows."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _fmix32_ref(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32_ref(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32_ref(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def seeded_uniforms_ref(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) (24 bits) that depend only on each row's int64 ``(seed, step)``."""
    seeds, steps = seeds.long(), steps.long()
    h = _fmix32_ref((steps & _MASK32) ^ _STEP_SALT.value)
    h = _fmix32_ref(h ^ ((seeds >> 32) & _MASK32))
    h = _fmix32_ref(h ^ (seeds & _MASK32))
    return (h >> 8).float() * 2.0**-24


def sample_tokens_ref(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    uniforms: torch.Tensor,
    seeds: torch.Tensor | None = None,
    steps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch reference: ``[rows, vocab]`` logits, ``[rows]`` temperatures and uniforms;
    with ``seeds`` and ``steps`` (int64), rows whose step is >= 0 use the seeded uniform."""
    if seeds is not None:
        uniforms = torch.where(steps >= 0, seeded_uniforms_ref(seeds, steps), uniforms.float())
    greedy = logits.argmax(dim=-1)
    inv_t = 1.0 / temperatures.float().clamp(min=1e-6)
    probs = (logits.float() * inv_t.unsqueeze(1)).softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)
    # the first index whose cdf exceeds u * total; rounding can leave none: take the last
    # token of positive probability then
    drawn = torch.searchsorted(cdf, (uniforms.float() * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    last_positive = torch.where(probs > 0, vocab, -1).amax(dim=-1)
    drawn = torch.minimum(drawn, last_positive)
    return torch.where(temperatures == 0, greedy, drawn)


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit(do_not_specialize=["vocab_size", "stride_row"])
def _sample_kernel(
    logits_ptr,
    temps_ptr,
    uniforms_ptr,
    seeds_ptr,
    steps_ptr,
    out_ptr,
    vocab_size,
    stride_row,
    HAS_SEEDS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    temp = tl.load(temps_ptr + row)
    scale = _LOG2E / tl.maximum(temp, 1e-6)
    lanes = tl.arange(0, BLOCK_V)
    # pass 1, per lane: the running max (first index on ties) and sum of 2^((x - max) * scale)
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_idx = tl.zeros([BLOCK_V], tl.int32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        offs = start + lanes
        x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        finite = new_max > float("-inf")
        rescale = tl.where(finite, tl.exp2((lane_max - new_max) * scale), 0.0)
        lane_sum = lane_sum * rescale + tl.where(finite, tl.exp2((x - new_max) * scale), 0.0)
        lane_idx = tl.where(x > lane_max, offs, lane_idx)
        lane_max = new_max
    row_max = tl.max(lane_max, 0)
    token = tl.min(tl.where(lane_max == row_max, lane_idx, vocab_size), 0)
    if temp != 0:
        total = tl.sum(
            lane_sum * tl.where(lane_max > float("-inf"), tl.exp2((lane_max - row_max) * scale), 0.0), 0
        )
        uniform = tl.load(uniforms_ptr + row)
        if HAS_SEEDS:
            step = tl.load(steps_ptr + row)
            if step >= 0:
                seed = tl.load(seeds_ptr + row)
                h = _fmix32(step.to(tl.uint32) ^ _STEP_SALT)
                h = _fmix32(h ^ (seed >> 32).to(tl.uint32))
                h = _fmix32(h ^ seed.to(tl.uint32))
                uniform = (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
        target = uniform * total
        # pass 2: the first index whose cumulative mass exceeds the target
        below = 0.0
        drawn = vocab_size
        last_positive = -1
        for start in range(0, vocab_size, BLOCK_V):
            offs = start + lanes
            x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
            p = tl.exp2((x - row_max) * scale)
            cdf = tl.cumsum(p, 0) + below
            drawn = tl.minimum(drawn, tl.min(tl.where(cdf > target, offs, vocab_size), 0))
            last_positive = tl.maximum(last_positive, tl.max(tl.where(p > 0, offs, -1), 0))
            below += tl.sum(p, 0)
        token = tl.minimum(drawn, last_positive)
    tl.store(out_ptr + row, token.to(out_ptr.dtype.element_ty))


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    uniforms: torch.Tensor,
    seeds: torch.Tensor | None = None,
    steps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`sample_tokens_ref` (same semantics); returns int64 token ids."""
    rows, vocab_size = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("logits need a unit stride in the last dimension")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    has_seeds = seeds is not None
    if rows:
        _sample_kernel[(rows,)](
            logits,
            temperatures.float().contiguous(),
            uniforms.float().contiguous(),
            seeds.long().contiguous() if has_seeds else out,
            steps.long().contiguous() if has_seeds else out,
            out,
            vocab_size,
            logits.stride(0),
            HAS_SEEDS=has_seeds,
            BLOCK_V=_BLOCK_V,
            num_warps=_NUM_WARPS,
        )
    return out
