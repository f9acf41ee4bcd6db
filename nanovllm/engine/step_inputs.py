"""A :class:`StepBatch` as device tensors: model inputs, attention metadata, sampling."""

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.attention import AttentionMetadata
from nanovllm.engine.batch import StepBatch
from nanovllm.layers.sampler import SamplingTensors


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    """Token ids; with ``tokens_from_previous``, rows of the previous step's sampled tokens."""
    positions: torch.Tensor
    meta: AttentionMetadata
    sampling: SamplingTensors | None


class StepInputBuilder:
    """Builds a step's tensors on the host and moves them to ``device`` in two transfers."""

    def __init__(self, device: torch.device, block_size: int):
        self.device = device
        self.block_size = block_size

    def _to_device(self, data, dtype: torch.dtype | None) -> torch.Tensor:
        t = torch.as_tensor(data, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _upload(self, int64_parts: list[np.ndarray], int32_parts: list[np.ndarray]) -> list[torch.Tensor]:
        """Copy many small host arrays with two transfers; returns device views, in order.

        Each view starts 16-byte aligned: Triton specialises kernels on pointer alignment, so
        views at varying alignments would compile a kernel again mid-run.
        """
        out = []
        for parts, dtype in ((int64_parts, np.int64), (int32_parts, np.int32)):
            unit = 16 // np.dtype(dtype).itemsize
            starts = [0]
            for p in parts:
                starts.append(starts[-1] + -(-p.size // unit) * unit)
            flat = np.zeros(starts[-1], dtype=dtype)
            for p, start in zip(parts, starts):
                flat[start : start + p.size] = np.ravel(p)
            flat = self._to_device(flat, None)
            out += [flat[start : start + p.size].view(p.shape) for p, start in zip(parts, starts)]
        return out

    @staticmethod
    def _block_table_array(batch: StepBatch) -> np.ndarray:
        width = max(len(blocks) for blocks in batch.block_tables)
        table = np.zeros((len(batch.block_tables), width), dtype=np.int32)
        for i, blocks in enumerate(batch.block_tables):
            table[i, : len(blocks)] = blocks
        return table

    def build(self, batch: StepBatch, with_sampling: bool = True) -> StepInputs:
        bs = self.block_size
        q_lens = np.fromiter((len(t) for t in batch.token_ids), dtype=np.int64, count=len(batch.token_ids))
        starts = np.asarray(batch.start_positions, dtype=np.int64)
        context_lens = starts + q_lens
        table = self._block_table_array(batch)
        seq_index = np.repeat(np.arange(len(q_lens)), q_lens)
        cu_q = np.concatenate([[0], np.cumsum(q_lens)])
        positions = np.arange(int(cu_q[-1])) - np.repeat(cu_q[:-1], q_lens) + starts[seq_index]
        slots = table[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        input_ids = np.fromiter(
            (t for tokens in batch.token_ids for t in tokens), dtype=np.int64, count=len(slots)
        )
        cu_k = np.concatenate([[0], np.cumsum(context_lens)]) if batch.is_prefill else np.empty(0, np.int64)
        # float32 temperatures travel bit-cast in the int32 transfer
        temps = np.asarray(batch.temperatures, dtype=np.float32).view(np.int32)
        ids_d, pos_d, slots_d, ctx_d, cu_q_d, cu_k_d, table_d, temps_d = self._upload(
            [input_ids, positions, slots], [context_lens, cu_q, cu_k, table, temps]
        )
        meta = AttentionMetadata(
            is_prefill=batch.is_prefill,
            slot_mapping=slots_d,
            context_lens=ctx_d,
            block_tables=table_d,
            cu_seqlens_q=cu_q_d if batch.is_prefill else None,
            cu_seqlens_k=cu_k_d if batch.is_prefill else None,
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=int(context_lens.max()),
            has_prefix=bool(starts.any()),
        )
        sampling = self._sampling_tensors(batch, temps_d.view(torch.float32)) if with_sampling else None
        return StepInputs(ids_d, pos_d, meta, sampling)

    def _sampling_tensors(self, batch: StepBatch, temperatures: torch.Tensor) -> SamplingTensors:
        st = SamplingTensors(temperatures)
        st.all_greedy = not any(batch.temperatures)
        if any(k > 0 for k in batch.top_ks):
            st.top_ks = self._to_device(batch.top_ks, torch.int64)
        if any(p < 1 for p in batch.top_ps):
            st.top_ps = self._to_device(batch.top_ps, torch.float32)
        if any(p > 0 for p in batch.min_ps):
            st.min_ps = self._to_device(batch.min_ps, torch.float32)
        if any(s is not None for s in batch.seeds):
            st.seeds, st.steps = batch.seeds, batch.steps
        return st
