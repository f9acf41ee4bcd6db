"""What the executor keeps per running sequence, by row, from step to step.

A step sends only what changed (:class:`StepBatch` ``new_rows`` and ``block_table_updates``),
so a decode step's plan stays small and its tables need not be rebuilt.
"""

import numpy as np
import torch

from nanovllm.scheduling.step import BlockTableUpdate, NewRow

_U64, _I64_SPAN = 2**64 - 1, 2**64


class BlockTables:
    """A host table (slots are computed from it) and its device copy (attention reads it);
    only the rows that changed are copied to the device. On CPU both are one tensor."""

    def __init__(self, num_rows: int, max_blocks_per_seq: int, device: torch.device):
        self.host = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)
        self.shares_memory = device.type == "cpu"
        if self.shares_memory:
            self.device = torch.from_numpy(self.host)
        else:
            self.device = torch.zeros(num_rows, max_blocks_per_seq, dtype=torch.int32, device=device)

    def update(self, updates: list[BlockTableUpdate]) -> np.ndarray:
        """Write new block ids into the host table; returns the rows whose device copy is
        now stale (none when the two share memory)."""
        for u in updates:
            end = u.start + len(u.block_ids)
            self.host[u.row, u.start : end] = u.block_ids
            if u.start == 0:  # a row taken over by another sequence: drop the old ids
                self.host[u.row, end:] = 0
        if self.shares_memory or not updates:
            return np.empty(0, dtype=np.int64)
        return np.unique(np.fromiter((u.row for u in updates), dtype=np.int64, count=len(updates)))

    def write_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Copy uploaded host rows into the device table."""
        self.device.index_copy_(0, rows, values)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """``[len(rows), max_blocks_per_seq]``: the tables of a batch's rows, in batch order."""
        return self.device.index_select(0, rows)


class SamplingRows:
    """Each row's prompt length and sampling parameters, as arrays a batch gathers from."""

    def __init__(self, num_rows: int):
        self.num_prompt_tokens = np.zeros(num_rows, dtype=np.int64)
        self.temperature = np.ones(num_rows, dtype=np.float32)
        self.top_k = np.full(num_rows, -1, dtype=np.int64)
        self.top_p = np.ones(num_rows, dtype=np.float32)
        self.min_p = np.zeros(num_rows, dtype=np.float32)
        self.seeded = np.zeros(num_rows, dtype=bool)
        self.seed = np.zeros(num_rows, dtype=np.int64)
        self.num_logprobs = np.full(num_rows, -1, dtype=np.int64)
        self.any_logprobs = False

    def update(self, new_rows: list[NewRow]) -> None:
        for r in new_rows:
            p = r.params
            self.num_prompt_tokens[r.row] = r.num_prompt_tokens
            self.temperature[r.row], self.top_k[r.row] = p.temperature, p.top_k
            self.top_p[r.row], self.min_p[r.row] = p.top_p, p.min_p
            self.seeded[r.row] = p.seed is not None
            self.num_logprobs[r.row] = -1 if p.logprobs is None else p.logprobs
            self.any_logprobs |= p.logprobs is not None
            if p.seed is not None:  # any Python int, as its 64 bits
                bits = p.seed & _U64
                self.seed[r.row] = bits - _I64_SPAN if bits >> 63 else bits

    def max_logprobs(self, rows: np.ndarray) -> int | None:
        """The most top log-probabilities a row of the batch asks for; None when none asks."""
        if not self.any_logprobs:
            return None
        k = int(self.num_logprobs[rows].max())
        return k if k >= 0 else None

    def arrays(self, rows: np.ndarray, last_positions: np.ndarray) -> dict[str, np.ndarray]:
        """The batch's per-row values; a filter no row uses is left out. A seeded row's draw
        depends on how many tokens it generated before (``steps``); unseeded rows get -1."""
        out = {"temperatures": self.temperature[rows]}
        top_k, top_p, min_p = self.top_k[rows], self.top_p[rows], self.min_p[rows]
        if (top_k > 0).any():
            out["top_ks"] = top_k
        if (top_p < 1).any():
            out["top_ps"] = top_p
        if (min_p > 0).any():
            out["min_ps"] = min_p
        seeded = self.seeded[rows]
        if seeded.any():
            out["seeds"] = self.seed[rows]
            out["steps"] = np.where(seeded, last_positions + 1 - self.num_prompt_tokens[rows], -1)
        return out
