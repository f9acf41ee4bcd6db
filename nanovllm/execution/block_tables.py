"""Every running sequence's block table, kept by row from step to step."""

import numpy as np
import torch

from nanovllm.scheduling import StepBatch


class BlockTables:
    """A host table (slots are computed from it) and its device copy (attention reads it).

    A step sends only the block ids its rows gained (:class:`StepBatch`); only the rows that
    changed are copied to the device. On CPU both are one tensor.
    """

    def __init__(self, num_rows: int, max_blocks_per_seq: int, device: torch.device):
        self.host = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)
        if device.type == "cpu":
            self.device = torch.from_numpy(self.host)
        else:
            self.device = torch.zeros(num_rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.shares_memory = device.type == "cpu"

    def update(self, batch: StepBatch) -> np.ndarray:
        """Write the batch's new block ids into the host table; returns the rows that changed
        (empty when the device copy is the host table)."""
        changed = []
        for row, start, new in zip(batch.rows, batch.block_table_starts, batch.new_block_ids):
            if not new:
                continue
            end = start + len(new)
            self.host[row, start:end] = new
            if start == 0:  # a row taken over by another sequence: drop the old ids
                self.host[row, end:] = 0
            changed.append(row)
        if self.shares_memory:
            return np.empty(0, dtype=np.int64)
        return np.asarray(changed, dtype=np.int64)

    def write_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Copy uploaded host rows into the device table."""
        if rows.numel():
            self.device.index_copy_(0, rows, values)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """``[len(rows), max_blocks_per_seq]``: the tables of a batch's rows, in batch order."""
        return self.device.index_select(0, rows)
