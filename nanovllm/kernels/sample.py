"""Drawing one token per row of logits by inverse transform sampling, in two kernels.

For row ``r`` with temperature ``T`` and a uniform ``u`` in [0, 1): the token is the first
index whose cumulative ``softmax(logits / T)`` exceeds ``u``; ``T == 0`` means argmax.
The first kernel splits every row into chunks and writes each chunk's max, argmax and
softmax mass, so a row is read by many programs at once; the second combines a row's chunks,
finds the chunk that holds the draw and scans that chunk alone. No vocabulary-sized tensor is
written, where sorting or Gumbel noise would write and read one.

A row that has no token to give is marked instead of sampled: :data:`NO_TOKEN` when every logit
is -inf (its request's constraints left nothing), :data:`NOT_FINITE` when a logit is NaN or
+inf (the model's output is broken).

A seeded row (``steps[r] >= 0``) takes its uniform from a hash of ``(seeds[r], steps[r])``
instead, so its draw depends on nothing else in the batch: murmur3's 32-bit finaliser
applied in turn to the step, the seed's high and its low word.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.device import pdl_options, wait_for_prior_grid

NO_TOKEN = -1
NOT_FINITE = -2
_NOT_FINITE = tl.constexpr(NOT_FINITE)
_NO_TOKEN = tl.constexpr(NO_TOKEN)
_LOG2E = tl.constexpr(1.4426950408889634)
_CHUNK = 4096  # logits per program of the first kernel; the second scans one chunk
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
    row_max, greedy = logits.float().max(dim=-1)
    inv_t = 1.0 / temperatures.float().clamp(min=1e-6)
    probs = (logits.float() * inv_t.unsqueeze(1)).softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)
    # the first index whose cdf exceeds u * total; rounding can leave none: take the last
    # token of positive probability then
    drawn = torch.searchsorted(cdf, (uniforms.float() * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    last_positive = torch.where(probs > 0, vocab, -1).amax(dim=-1)
    drawn = torch.minimum(drawn, last_positive)
    return _mark_rows_without_a_token(torch.where(temperatures == 0, greedy, drawn), row_max)


def _mark_rows_without_a_token(tokens: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """``tokens`` with :data:`NO_TOKEN` / :data:`NOT_FINITE` where a row's largest logit
    (NaN when the row holds one) says it has no token to give."""
    tokens = torch.where(row_max == float("-inf"), NO_TOKEN, tokens)
    return torch.where(row_max.isnan() | (row_max == float("inf")), NOT_FINITE, tokens)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token (the first of equals), rows without a token marked as
    :func:`sample_tokens` marks them."""
    row_max, tokens = logits.max(dim=-1)
    return _mark_rows_without_a_token(tokens, row_max)


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit(do_not_specialize=["vocab_size", "stride_row", "num_chunks"])
def _chunk_stats_kernel(
    logits_ptr,
    temps_ptr,
    max_ptr,
    argmax_ptr,
    mass_ptr,
    vocab_size,
    stride_row,
    num_chunks,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per (row, chunk): the max logit, its first index, and the sum of 2^((x - max) * scale)."""
    wait_for_prior_grid(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
    scale = _LOG2E / tl.maximum(tl.load(temps_ptr + row), 1e-6)
    chunk_max = tl.max(x, 0)
    first = tl.min(tl.where(x == chunk_max, offs, vocab_size), 0)
    # NaN compares false everywhere (the max may skip it): flagged in the argmax
    not_finite = tl.sum(((x != x) | (x == float("inf"))).to(tl.int32), 0)
    first = tl.where(not_finite > 0, _NOT_FINITE, first)
    mass = tl.sum(tl.where(x > float("-inf"), tl.exp2((x - chunk_max) * scale), 0.0), 0)
    out = row * num_chunks + chunk
    tl.store(max_ptr + out, chunk_max)
    tl.store(argmax_ptr + out, first)
    tl.store(mass_ptr + out, mass)


@triton.jit(do_not_specialize=["vocab_size", "stride_row", "num_chunks"])
def _sample_kernel(
    logits_ptr,
    temps_ptr,
    uniforms_ptr,
    seeds_ptr,
    steps_ptr,
    max_ptr,
    argmax_ptr,
    mass_ptr,
    out_ptr,
    vocab_size,
    stride_row,
    num_chunks,
    HAS_SEEDS: tl.constexpr,
    CHUNK: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior_grid(PDL)
    row = tl.program_id(0)
    chunks = tl.arange(0, MAX_CHUNKS)
    valid = chunks < num_chunks
    stats = row * num_chunks + chunks
    chunk_max = tl.load(max_ptr + stats, mask=valid, other=float("-inf"))
    row_max = tl.max(chunk_max, 0)
    chunk_argmax = tl.load(argmax_ptr + stats, mask=valid, other=vocab_size)
    token = tl.min(tl.where(chunk_max == row_max, chunk_argmax, vocab_size), 0)
    temp = tl.load(temps_ptr + row)
    if temp != 0:
        scale = _LOG2E / tl.maximum(temp, 1e-6)
        mass = tl.load(mass_ptr + stats, mask=valid, other=0.0)
        mass = tl.where(chunk_max > float("-inf"), mass * tl.exp2((chunk_max - row_max) * scale), 0.0)
        uniform = tl.load(uniforms_ptr + row)
        if HAS_SEEDS:
            step = tl.load(steps_ptr + row)
            if step >= 0:
                seed = tl.load(seeds_ptr + row)
                h = _fmix32(step.to(tl.uint32) ^ _STEP_SALT)
                h = _fmix32(h ^ (seed >> 32).to(tl.uint32))
                h = _fmix32(h ^ seed.to(tl.uint32))
                uniform = (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
        target = uniform * tl.sum(mass, 0)
        cdf = tl.cumsum(mass, 0)
        # the chunk holding the target; rounding can leave none: the last chunk with mass then
        chosen = tl.min(tl.where(cdf > target, chunks, MAX_CHUNKS), 0)
        chosen = tl.maximum(tl.minimum(chosen, tl.max(tl.where(mass > 0, chunks, -1), 0)), 0)
        below = tl.sum(tl.where(chunks == chosen, cdf - mass, 0.0), 0)
        offs = chosen * CHUNK + tl.arange(0, CHUNK)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=float("-inf")).to(tl.float32)
        p = tl.exp2((x - row_max) * scale)
        drawn = tl.min(tl.where(tl.cumsum(p, 0) + below > target, offs, vocab_size), 0)
        token = tl.minimum(drawn, tl.max(tl.where(p > 0, offs, -1), 0))
    token = tl.where(row_max == float("-inf"), _NO_TOKEN, token)
    token = tl.where(tl.min(chunk_argmax, 0) < 0, _NOT_FINITE, token)
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
    if not rows:
        return out
    has_seeds = seeds is not None
    num_chunks = triton.cdiv(vocab_size, _CHUNK)
    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_mass = torch.empty_like(chunk_max)
    chunk_argmax = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    temperatures = temperatures.float().contiguous()
    _chunk_stats_kernel[(rows, num_chunks)](
        logits,
        temperatures,
        chunk_max,
        chunk_argmax,
        chunk_mass,
        vocab_size,
        logits.stride(0),
        num_chunks,
        CHUNK=_CHUNK,
        num_warps=_NUM_WARPS,
        **pdl_options(logits.device),
    )
    _sample_kernel[(rows,)](
        logits,
        temperatures,
        uniforms.float().contiguous(),
        seeds.long().contiguous() if has_seeds else out,
        steps.long().contiguous() if has_seeds else out,
        chunk_max,
        chunk_argmax,
        chunk_mass,
        out,
        vocab_size,
        logits.stride(0),
        num_chunks,
        HAS_SEEDS=has_seeds,
        CHUNK=_CHUNK,
        MAX_CHUNKS=triton.next_power_of_2(num_chunks),
        num_warps=_NUM_WARPS,
        **pdl_options(logits.device),
    )
    return out
