"""A :class:`StepBatch` as device tensors: model inputs, attention metadata, sampling."""

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.attention import AttentionMetadata
from nanovllm.config import Config
from nanovllm.execution.logits_processors import LogitsRows
from nanovllm.execution.row_state import BlockTables, SamplingRows
from nanovllm.execution.sampler import SamplingTensors
from nanovllm.scheduling import StepBatch

_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
}


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    """Token ids of the rows after the first ``len(previous_sample_rows)``."""
    previous_sample_rows: torch.Tensor | None
    """Rows of the previous step's sampled tokens: the inputs of this step's first rows."""
    positions: torch.Tensor
    meta: AttentionMetadata
    sampling: SamplingTensors | None
    last_token_index: torch.Tensor | None
    """With prompt chunks: where each row's last token is, whose hidden state gives its logits."""
    max_logprobs: int | None = None
    """The most top log-probabilities a row asks for (None: no row wants log-probabilities)."""
    rope_lengths: torch.Tensor | None = None
    """For a model whose rotary embedding depends on the sequence length: each token's
    ``max(position + 1, prompt length)``; None where that is ``position + 1`` throughout."""


class StepInputBuilder:
    """Builds a step's tensors on the host and moves them to the device in two transfers,
    keeping each row's block table and sampling parameters between steps. With
    ``rope_lengths``, steps carry each token's length for the rotary embedding."""

    def __init__(self, config: Config, device: torch.device, rope_lengths: bool = False):
        self.device = device
        self.rope_lengths = rope_lengths
        self.block_size = config.kvcache_block_size
        self.block_tables = BlockTables(config.max_num_seqs, config.max_blocks_per_seq, device)
        self.sampling_rows = SamplingRows(config.max_num_seqs)
        self.logits_rows = LogitsRows(config.max_num_seqs, config.max_model_len, config.eos_token_ids, device)

    def _upload(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Copy many small host arrays with one transfer per element size; returns device views.

        Each view starts 16-byte aligned: Triton specialises kernels on pointer alignment, so
        views at varying alignments would compile a kernel again mid-run.
        """
        out = {}
        for carrier in (np.dtype(np.int64), np.dtype(np.int32)):
            group = {name: a for name, a in arrays.items() if a.dtype.itemsize == carrier.itemsize}
            unit = 16 // carrier.itemsize
            starts, total = {}, 0
            for name, a in group.items():
                starts[name] = total
                total += -(-a.size // unit) * unit
            flat = np.zeros(total, dtype=carrier)
            for name, a in group.items():
                flat[starts[name] : starts[name] + a.size] = a.reshape(-1).view(carrier)
            flat = torch.from_numpy(flat)
            if self.device.type == "cuda":
                flat = flat.pin_memory().to(self.device, non_blocking=True)
            for name, a in group.items():
                view = flat[starts[name] : starts[name] + a.size].view(a.shape)
                out[name] = view.view(_TORCH_DTYPES[a.dtype])
        return out

    def build(self, batch: StepBatch, with_sampling: bool = True) -> StepInputs:
        bs, n, d = self.block_size, len(batch), batch.num_decode_rows
        rows = np.asarray(batch.rows, dtype=np.int64)
        stale_rows = self.block_tables.update(batch.block_table_updates)
        self.sampling_rows.update(batch.new_rows)
        starts = np.asarray(batch.start_positions, dtype=np.int64)
        q_lens = np.asarray(batch.num_tokens, dtype=np.int64)
        if batch.is_decode:
            row_of_token, positions = np.arange(n), starts
        else:
            row_of_token = np.repeat(np.arange(n), q_lens)
            cu_q = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(q_lens, out=cu_q[1:])
            positions = np.arange(cu_q[-1]) - cu_q[:-1][row_of_token] + starts[row_of_token]
        context_lens = starts + q_lens
        blocks = self.block_tables.host[rows[row_of_token], positions // bs].astype(np.int64)
        arrays = {
            # first, at storage offset 0: compiled code guards on its inputs' offsets
            "positions": positions,
            "input_ids": np.asarray(batch.token_ids, dtype=np.int64),
            "slots": blocks * bs + positions % bs,
            "rows": rows,
            "context_lens": context_lens.astype(np.int32),
            # longest first: a decode program that starts last should not be a long one
            "decode_order": np.argsort(-context_lens[:d], kind="stable").astype(np.int32),
        }
        if self.rope_lengths:
            # a prompt token is rotated as in its whole prompt, also in a chunk or a recomputation
            lengths = np.maximum(positions + 1, self.sampling_rows.num_prompt_tokens[rows[row_of_token]])
            # decode steps go without (CUDA graphs), unless a one-token prompt chunk needs it
            if not batch.is_decode or (lengths > positions + 1).any():
                arrays["rope_lengths"] = lengths
        if batch.previous_sample_rows:
            arrays["previous_sample_rows"] = np.asarray(batch.previous_sample_rows, dtype=np.int64)
        if stale_rows.size:
            arrays["stale_rows"] = stale_rows
            arrays["stale_tables"] = self.block_tables.host[stale_rows]
        if not batch.is_decode:  # the prompt rows, after the decode rows (one token each)
            cu_k = np.zeros(n - d + 1, dtype=np.int32)
            np.cumsum(context_lens[d:], out=cu_k[1:])
            arrays.update(cu_q=(cu_q[d:] - d).astype(np.int32), cu_k=cu_k, last_token_index=cu_q[1:] - 1)
        if with_sampling:  # only rank 0 samples, so only it keeps the logits-processing rows
            self.logits_rows.update(batch.new_rows)
            arrays.update(self.sampling_rows.arrays(rows, context_lens - 1))
            arrays.update(self.logits_rows.arrays(rows, context_lens))
        dev = self._upload(arrays)
        if stale_rows.size:
            self.block_tables.write_rows(dev["stale_rows"], dev["stale_tables"])
        block_tables = self.block_tables.gather(dev["rows"])
        if batch.is_decode:
            meta = AttentionMetadata(
                is_prefill=False,
                slot_mapping=dev["slots"],
                context_lens=dev["context_lens"],
                block_tables=block_tables,
                max_seqlen_k=int(context_lens.max()),
                has_prefix=bool(starts.any()),
                decode_order=dev["decode_order"],
            )
        else:
            meta = self._mixed_metadata(dev, block_tables, d, starts, q_lens, context_lens)
        sampling = None
        if with_sampling:
            sampling = SamplingTensors(
                dev["temperatures"],
                top_ks=dev.get("top_ks"),
                top_ps=dev.get("top_ps"),
                min_ps=dev.get("min_ps"),
                seeds=dev.get("seeds"),
                steps=dev.get("steps"),
                all_greedy=not arrays["temperatures"].any(),
                processing=self.logits_rows.tensors(dev, arrays),
            )
        return StepInputs(
            dev["input_ids"],
            dev.get("previous_sample_rows"),
            dev["positions"],
            meta,
            sampling,
            dev.get("last_token_index"),
            self.sampling_rows.max_logprobs(rows) if with_sampling else None,
            dev.get("rope_lengths"),
        )

    @staticmethod
    def _mixed_metadata(dev, block_tables, d, starts, q_lens, context_lens) -> AttentionMetadata:
        """Prompt rows described from row ``d`` on; the ``d`` decode rows before them, if any,
        in a metadata of their own."""
        decode = None
        if d:
            decode = AttentionMetadata(
                is_prefill=False,
                slot_mapping=dev["slots"][:d],
                context_lens=dev["context_lens"][:d],
                block_tables=block_tables[:d],
                max_seqlen_k=int(context_lens[:d].max()),
                has_prefix=bool(starts[:d].any()),
                decode_order=dev["decode_order"],
            )
        return AttentionMetadata(
            is_prefill=True,
            slot_mapping=dev["slots"],
            context_lens=dev["context_lens"][d:],
            block_tables=block_tables[d:],
            cu_seqlens_q=dev["cu_q"],
            cu_seqlens_k=dev["cu_k"],
            max_seqlen_q=int(q_lens[d:].max()),
            max_seqlen_k=int(context_lens[d:].max()),
            has_prefix=bool(starts[d:].any()),
            decode=decode,
        )
