"""A :class:`StepBatch` as device tensors: model inputs, attention metadata, sampling."""

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.attention import AttentionMetadata
from nanovllm.config import Config
from nanovllm.execution.sampler import SamplingTensors
from nanovllm.execution.slot_table import SlotTable
from nanovllm.execution.upload import upload
from nanovllm.scheduling import StepBatch


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


@dataclass(slots=True)
class _TokenArrays:
    """A step's per-token and per-row arrays, built on the host, then uploaded in place."""

    positions: np.ndarray  # first, at storage offset 0: compiled code guards on its inputs' offsets
    input_ids: np.ndarray
    slot_mapping: np.ndarray
    slots: np.ndarray
    context_lens: np.ndarray
    decode_order: np.ndarray
    """Longest first: a decode program that starts last should not be a long one."""
    rope_lengths: np.ndarray | None = None
    previous_sample_rows: np.ndarray | None = None
    stale_slots: np.ndarray | None = None
    stale_tables: np.ndarray | None = None
    cu_seqlens_q: np.ndarray | None = None
    cu_seqlens_k: np.ndarray | None = None
    last_token_index: np.ndarray | None = None


class StepInputBuilder:
    """Builds a step's tensors on the host and moves them to the device in one transfer,
    keeping each slot's state (:class:`SlotTable`) between steps. With ``rope_lengths``, steps
    carry each token's length for the rotary embedding; with ``samples``, sampling inputs."""

    def __init__(
        self, config: Config, device: torch.device, rope_lengths: bool = False, samples: bool = True
    ):
        self.device = device
        self.rope_lengths = rope_lengths
        self.block_size = config.kvcache_block_size
        self.slot_table = SlotTable(
            config.max_num_seqs,
            config.max_blocks_per_seq,
            config.max_model_len,
            config.eos_token_ids,
            device,
            samples,
        )

    def build(self, batch: StepBatch) -> StepInputs:
        bs, n, d = self.block_size, len(batch), batch.num_single_token_rows
        table = self.slot_table
        slots = np.asarray(batch.slots, dtype=np.int64)
        stale_slots = table.update(batch)
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
        blocks = table.block_tables.host[slots[row_of_token], positions // bs].astype(np.int64)
        arrays = _TokenArrays(
            positions=positions,
            input_ids=np.asarray(batch.token_ids, dtype=np.int64),
            slot_mapping=blocks * bs + positions % bs,
            slots=slots,
            context_lens=context_lens.astype(np.int32),
            decode_order=np.argsort(-context_lens[:d], kind="stable").astype(np.int32),
        )
        if self.rope_lengths:
            # a prompt token is rotated as in its whole prompt, also in a chunk or a recomputation
            lengths = np.maximum(positions + 1, table.num_prompt_tokens[slots[row_of_token]])
            # decode steps go without (CUDA graphs), unless a one-token prompt chunk needs it
            if not batch.is_decode or (lengths > positions + 1).any():
                arrays.rope_lengths = lengths
        if batch.previous_sample_rows:
            arrays.previous_sample_rows = np.asarray(batch.previous_sample_rows, dtype=np.int64)
        if stale_slots.size:
            arrays.stale_slots = stale_slots
            arrays.stale_tables = table.block_tables.host[stale_slots]
        if not batch.is_decode:  # the prompt rows, after the single-token rows
            cu_k = np.zeros(n - d + 1, dtype=np.int32)
            np.cumsum(context_lens[d:], out=cu_k[1:])
            arrays.cu_seqlens_q = (cu_q[d:] - d).astype(np.int32)
            arrays.cu_seqlens_k = cu_k
            arrays.last_token_index = cu_q[1:] - 1
        sampling = max_logprobs = None
        if table.sampling is not None:
            prompt_lens = table.num_prompt_tokens[slots]
            sampling = table.sampling.gather(slots, context_lens - prompt_lens)
            sampling.processing = table.logits.gather(slots, context_lens, prompt_lens)
            max_logprobs = table.sampling.max_logprobs(slots)
        groups = [arrays] if sampling is None else [arrays, sampling]
        if sampling is not None and sampling.processing is not None:
            groups.append(sampling.processing)
        upload(self.device, *groups)
        if stale_slots.size:
            table.block_tables.write_slots(arrays.stale_slots, arrays.stale_tables)
        block_tables = table.block_tables.gather(arrays.slots)
        if batch.is_decode:
            meta = AttentionMetadata(
                is_prefill=False,
                slot_mapping=arrays.slot_mapping,
                context_lens=arrays.context_lens,
                block_tables=block_tables,
                max_seqlen_k=int(context_lens.max()),
                has_prefix=bool(starts.any()),
                decode_order=arrays.decode_order,
            )
        else:
            meta = self._mixed_metadata(arrays, block_tables, d, starts, q_lens, context_lens)
        return StepInputs(
            arrays.input_ids,
            arrays.previous_sample_rows,
            arrays.positions,
            meta,
            sampling,
            arrays.last_token_index,
            max_logprobs,
            arrays.rope_lengths,
        )

    @staticmethod
    def _mixed_metadata(arrays, block_tables, d, starts, q_lens, context_lens) -> AttentionMetadata:
        """Prompt rows described from row ``d`` on; the ``d`` single-token rows before them, if
        any, in a metadata of their own."""
        decode = None
        if d:
            decode = AttentionMetadata(
                is_prefill=False,
                slot_mapping=arrays.slot_mapping[:d],
                context_lens=arrays.context_lens[:d],
                block_tables=block_tables[:d],
                max_seqlen_k=int(context_lens[:d].max()),
                has_prefix=bool(starts[:d].any()),
                decode_order=arrays.decode_order,
            )
        return AttentionMetadata(
            is_prefill=True,
            slot_mapping=arrays.slot_mapping,
            context_lens=arrays.context_lens[d:],
            block_tables=block_tables[d:],
            cu_seqlens_q=arrays.cu_seqlens_q,
            cu_seqlens_k=arrays.cu_seqlens_k,
            max_seqlen_q=int(q_lens[d:].max()),
            seqlens_q=tuple(q_lens[d:].tolist()),
            max_seqlen_k=int(context_lens[d:].max()),
            has_prefix=bool(starts[d:].any()),
            decode=decode,
        )
