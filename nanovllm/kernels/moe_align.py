"""Group a mixture-of-experts routing by expert, padded per expert to the GEMM tile height, beside a
torch reference: one Triton program for a decode step's few pairs, three launches (count per chunk
of pairs, place the chunks, scatter) where many chunks pay for running in parallel."""

import torch
import triton
import triton.language as tl


def _check(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> int:
    """Validates the arguments; returns the rows of ``sorted_ids`` (whole blocks, worst case)."""
    if topk_ids.dim() != 2 or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be a 2-d integer tensor: {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts and block_m must be positive: {num_experts}, {block_m}")
    max_rows = topk_ids.numel() + num_experts * (block_m - 1)
    return max_rows + -max_rows % block_m


def moe_align_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay the ``tokens * top_k`` (token, k) pairs out expert by expert, each expert's run padded
    to a multiple of ``block_m`` rows, so a block of ``block_m`` rows belongs to one expert.

    ``topk_ids``: ``[tokens, top_k]`` integer expert ids, all in ``[0, num_experts)`` (not checked:
    that would sync with the host). Pair ``p = token * top_k + k``.

    Returns, all on ``topk_ids.device`` and sized for the worst case so that no host sync is needed
    (and CUDA graphs can capture it):

    - ``sorted_ids``: int32 ``[tokens * top_k + num_experts * (block_m - 1)]`` rounded up to whole
      blocks, the pairs grouped by expert (in pair order within an expert), padding rows and the
      unused tail set to ``tokens * top_k`` (an invalid pair);
    - ``expert_of_block``: int32 ``[len(sorted_ids) / block_m]``, the expert of each block of rows,
      ``num_experts`` for blocks past the end;
    - ``num_padded``: int32 ``[1]``, the rows in use; blocks starting at or after it are empty.
    """
    max_rows = _check(topk_ids, num_experts, block_m)
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    # scatter_add_ rather than bincount: CUDA bincount reads the max back to the host
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    # a stable sort keeps pairs in order within an expert; rank = place within the expert's run
    order = torch.sort(flat, stable=True).indices
    expert = flat[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[expert]
    sorted_ids = torch.full((max_rows,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, (ends - padded)[expert] + rank, order.int())
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    expert_of_block = torch.searchsorted(ends, block_starts, right=True).int()
    return sorted_ids, expert_of_block, ends[-1:].int()


@triton.jit
def _one_hot(ids_ptr, chunk, num_pairs, CHUNK: tl.constexpr, EXPERTS: tl.constexpr):
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1).to(tl.int32)
    return pairs, (ids[:, None] == tl.arange(0, EXPERTS)[None, :]).to(tl.int32)


@triton.jit
def _lay_out_runs(
    counts, expert_of_block_ptr, num_padded_ptr, num_experts, num_blocks, block_m,
    EXPERTS: tl.constexpr, BLOCKS: tl.constexpr,
):  # fmt: skip
    """From the experts' pair counts: each expert's run padded to whole blocks, the expert of every
    block and the rows in use stored; returns the runs' first rows."""
    experts = tl.arange(0, EXPERTS)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_padded_ptr, tl.max(ends, axis=0))
    far_ends = tl.where(experts < num_experts, ends, 2**30)  # so blocks past the end get num_experts
    for b0 in range(0, num_blocks, BLOCKS):
        blocks = b0 + tl.arange(0, BLOCKS)
        expert = tl.sum((far_ends[None, :] <= (blocks * block_m)[:, None]).to(tl.int32), axis=1)
        tl.store(expert_of_block_ptr + blocks, expert, mask=blocks < num_blocks)
    return ends - padded


@triton.jit(do_not_specialize=["num_pairs", "max_rows", "rows_per_program"])
def _count_kernel(
    ids_ptr, chunk_counts_ptr, sorted_ids_ptr, num_pairs, max_rows, rows_per_program,
    CHUNK: tl.constexpr, EXPERTS: tl.constexpr,
):  # fmt: skip
    """Per chunk of pairs, how many go to each expert; every row of ``sorted_ids`` is set to the
    invalid pair (the scatter overwrites the used ones after this launch)."""
    chunk = tl.program_id(0)
    _, hot = _one_hot(ids_ptr, chunk, num_pairs, CHUNK, EXPERTS)
    tl.store(chunk_counts_ptr + chunk * EXPERTS + tl.arange(0, EXPERTS), tl.sum(hot, axis=0))
    for r0 in range(chunk * rows_per_program, (chunk + 1) * rows_per_program, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + rows, tl.full((CHUNK,), num_pairs, tl.int32), mask=rows < max_rows)


@triton.jit(do_not_specialize=["num_chunks", "num_blocks"])
def _place_kernel(
    chunk_counts_ptr, expert_start_ptr, expert_of_block_ptr, num_padded_ptr,
    num_chunks, num_experts, num_blocks, block_m,
    CHUNKS: tl.constexpr, EXPERTS: tl.constexpr, BLOCKS: tl.constexpr,
):  # fmt: skip
    """One program: each chunk's first row in each expert's run (in place of its counts), the
    runs' starts, the expert of every block and the rows in use."""
    experts = tl.arange(0, EXPERTS)
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for c0 in range(0, num_chunks, CHUNKS):
        chunks = c0 + tl.arange(0, CHUNKS)
        ptrs = chunk_counts_ptr + chunks[:, None] * EXPERTS + experts[None, :]
        tile = tl.load(ptrs, mask=chunks[:, None] < num_chunks, other=0)
        tl.store(ptrs, counts[None, :] + tl.cumsum(tile, axis=0) - tile, mask=chunks[:, None] < num_chunks)
        counts += tl.sum(tile, axis=0)
    starts = _lay_out_runs(
        counts, expert_of_block_ptr, num_padded_ptr, num_experts, num_blocks, block_m, EXPERTS, BLOCKS
    )
    tl.store(expert_start_ptr + experts, starts)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(
    ids_ptr, chunk_counts_ptr, expert_start_ptr, sorted_ids_ptr, num_pairs,
    CHUNK: tl.constexpr, EXPERTS: tl.constexpr,
):  # fmt: skip
    """Each pair to its row: its expert's start + pairs of that expert in earlier chunks + its
    rank among the chunk's pairs of that expert (pair order kept)."""
    chunk = tl.program_id(0)
    pairs, hot = _one_hot(ids_ptr, chunk, num_pairs, CHUNK, EXPERTS)
    base = tl.load(expert_start_ptr + tl.arange(0, EXPERTS))
    base += tl.load(chunk_counts_ptr + chunk * EXPERTS + tl.arange(0, EXPERTS))
    row = tl.sum(hot * (base[None, :] + tl.cumsum(hot, axis=0) - 1), axis=1)
    tl.store(sorted_ids_ptr + row, pairs.to(tl.int32), mask=pairs < num_pairs)


@triton.jit(do_not_specialize=["num_pairs", "num_experts", "max_rows", "num_blocks", "block_m"])
def _one_program_kernel(
    ids_ptr, sorted_ids_ptr, expert_of_block_ptr, num_padded_ptr,
    num_pairs, num_experts, max_rows, num_blocks, block_m,
    CHUNK: tl.constexpr, EXPERTS: tl.constexpr, BLOCKS: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """The three launches' work in one program: the experts' counts, their runs' starts, the
    expert of every block, then each pair to its row (the counts of earlier chunks kept in
    registers rather than written out)."""
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        _, hot = _one_hot(ids_ptr, c0 // CHUNK, num_pairs, CHUNK, EXPERTS)
        counts += tl.sum(hot, axis=0)
    starts = _lay_out_runs(
        counts, expert_of_block_ptr, num_padded_ptr, num_experts, num_blocks, block_m, EXPERTS, BLOCKS
    )
    for r0 in range(0, max_rows, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        tl.store(sorted_ids_ptr + rows, tl.full((ROWS,), num_pairs, tl.int32), mask=rows < max_rows)
    tl.debug_barrier()  # every thread's invalid marks land before any pair overwrites one
    for c0 in range(0, num_pairs, CHUNK):
        pairs, hot = _one_hot(ids_ptr, c0 // CHUNK, num_pairs, CHUNK, EXPERTS)
        row = tl.sum(hot * (starts[None, :] + tl.cumsum(hot, axis=0) - 1), axis=1)
        tl.store(sorted_ids_ptr + row, pairs.to(tl.int32), mask=pairs < num_pairs)
        starts += tl.sum(hot, axis=0)


# up to this many chunks of pairs (a chunk: 128 pairs at 128 experts, 16 tokens of top-8) one program
# beats three launches: 7.3-7.7 against 10.2-11.5 us a call at 1-16 tokens, 11.4 against 12.1 at 32,
# 17.3 against 12.2 at 64 (H200, `bench_fused_moe.py --align`)
ONE_PROGRAM_MAX_CHUNKS = 1


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, *, one_program: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`moe_align_ref`: same arguments, same outputs. ``one_program``
    picks the single-program kernel or the three launches (default: by the number of pairs)."""
    max_rows = _check(topk_ids, num_experts, block_m)
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    ids = topk_ids.reshape(-1)
    experts = triton.next_power_of_2(num_experts)
    chunk = max(16, 16384 // experts)  # a [chunk, experts] one-hot tile per program
    num_chunks = max(triton.cdiv(num_pairs, chunk), 1)
    num_blocks = max_rows // block_m
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=device)
    expert_of_block = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    if one_program is None:
        one_program = num_chunks <= ONE_PROGRAM_MAX_CHUNKS
    if one_program:
        _one_program_kernel[(1,)](
            ids, sorted_ids, expert_of_block, num_padded,
            num_pairs, num_experts, max_rows, num_blocks, block_m,
            CHUNK=chunk, EXPERTS=experts, BLOCKS=max(16, 4096 // experts), ROWS=1024,
        )  # fmt: skip
        return sorted_ids, expert_of_block, num_padded
    chunk_counts = torch.empty(num_chunks, experts, dtype=torch.int32, device=device)
    expert_start = torch.empty(experts, dtype=torch.int32, device=device)
    rows_per_program = triton.cdiv(triton.cdiv(max_rows, num_chunks), chunk) * chunk
    _count_kernel[(num_chunks,)](
        ids, chunk_counts, sorted_ids, num_pairs, max_rows, rows_per_program, CHUNK=chunk, EXPERTS=experts
    )
    _place_kernel[(1,)](
        chunk_counts, expert_start, expert_of_block, num_padded, num_chunks, num_experts, num_blocks, block_m,
        CHUNKS=max(1, 4096 // experts), EXPERTS=experts, BLOCKS=max(16, 4096 // experts),
    )  # fmt: skip
    _scatter_kernel[(num_chunks,)](
        ids, chunk_counts, expert_start, sorted_ids, num_pairs, CHUNK=chunk, EXPERTS=experts
    )
    return sorted_ids, expert_of_block, num_padded
