"""Group a mixture-of-experts routing by expert, padded per expert to the GEMM tile height."""

import torch


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay the ``tokens * top_k`` (token, k) pairs out expert by expert, each expert's run padded
    to a multiple of ``block_m`` rows, so a block of ``block_m`` rows belongs to one expert.

    ``topk_ids``: ``[tokens, top_k]`` integer expert ids, all in ``[0, num_experts)`` (not checked:
    that would sync with the host). Pair ``p = token * top_k + k``.

    Returns, all on ``topk_ids.device`` and sized for the worst case so that no host sync is needed
    (and CUDA graphs can capture it):

    - ``sorted_ids``: int32 ``[tokens * top_k + num_experts * (block_m - 1)]``, the pairs grouped by
      expert (in pair order within an expert), padding rows and the unused tail set to
      ``tokens * top_k`` (an invalid pair);
    - ``expert_of_block``: int32 ``[len(sorted_ids) / block_m]``, the expert of each block of rows,
      ``num_experts`` for blocks past the end;
    - ``num_padded``: int32 ``[1]``, the rows in use; blocks starting at or after it are empty.
    """
    if topk_ids.dim() != 2 or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be a 2-d integer tensor: {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts and block_m must be positive: {num_experts}, {block_m}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    max_rows = n + num_experts * (block_m - 1)
    max_rows += -max_rows % block_m  # whole blocks
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
