"""What the executor keeps per slot (per running sequence) from step to step.

A step sends only what changed (:class:`StepBatch` ``new_slots`` and ``block_table_updates``),
so a decode step's plan stays small and its tables need not be rebuilt.
"""

import numpy as np
import torch

from nanovllm.execution.logits_processors import LogitsSlots
from nanovllm.execution.sampler import SamplingSlots
from nanovllm.scheduling.step import BlockTableUpdate, StepBatch


class BlockTables:
    """A host table (slot mappings are computed from it) and its device copy (attention reads
    it); only the slots that changed are copied to the device. On CPU both are one tensor."""

    def __init__(self, num_slots: int, max_blocks_per_seq: int, device: torch.device):
        self.host = np.zeros((num_slots, max_blocks_per_seq), dtype=np.int32)
        self.shares_memory = device.type == "cpu"
        if self.shares_memory:
            self.device = torch.from_numpy(self.host)
        else:
            self.device = torch.zeros(num_slots, max_blocks_per_seq, dtype=torch.int32, device=device)

    def update(self, updates: list[BlockTableUpdate]) -> np.ndarray:
        """Write new block ids into the host table; returns the slots whose device copy is
        now stale (none when the two share memory)."""
        for u in updates:
            end = u.start + len(u.block_ids)
            self.host[u.slot, u.start : end] = u.block_ids
            if u.start == 0:  # a slot taken over by another sequence: drop the old ids
                self.host[u.slot, end:] = 0
        if self.shares_memory or not updates:
            return np.empty(0, dtype=np.int64)
        return np.unique(np.fromiter((u.slot for u in updates), dtype=np.int64, count=len(updates)))

    def write_slots(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Copy uploaded host rows of the table into the device table."""
        self.device.index_copy_(0, slots, values)

    @property
    def width(self) -> int:
        """Block ids a slot's table holds (``max_blocks_per_seq``)."""
        return self.host.shape[1]


class SlotTable:
    """The one owner of per-slot state: block table, prompt length and, on the rank that
    samples, the sampling and logits-processing parameters. A new per-request parameter
    belongs to the part its consumer reads (:class:`SamplingSlots`, :class:`LogitsSlots`)."""

    def __init__(
        self,
        num_slots: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        samples: bool,
    ):
        self.block_tables = BlockTables(num_slots, max_blocks_per_seq, device)
        self.num_prompt_tokens = np.zeros(num_slots, dtype=np.int64)
        self.sampling = SamplingSlots(num_slots) if samples else None
        self.logits = LogitsSlots(num_slots, max_model_len, eos_token_ids, device) if samples else None

    def update(self, batch: StepBatch) -> np.ndarray:
        """Take the batch's new slots and block ids; returns the slots whose device block
        table is now stale."""
        for new in batch.new_slots:
            self.num_prompt_tokens[new.slot] = new.num_prompt_tokens
            if self.sampling is not None:
                self.sampling.assign(new)
                self.logits.assign(new)
        return self.block_tables.update(batch.block_table_updates)
