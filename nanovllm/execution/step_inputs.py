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

_PADDED_TAIL_BYTES = 1 << 20
"""Room after a padded decode step's rows in its upload buffer, for its sampling arrays and
block-table changes (more goes to a buffer of its own)."""


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    """One per token; a token taken from the previous step's samples (``sampled_from``) holds 0."""
    sampled_from: torch.Tensor | None
    """One per token: the row of the previous step's samples that is this token, or -1 (the token
    is in ``input_ids``); None when no token is a sample."""
    positions: torch.Tensor
    slots: torch.Tensor
    """Each row's slot, whose block table :meth:`resolve` gathers into ``block_tables``."""
    block_tables: torch.Tensor
    """``[rows, max_blocks_per_seq]``, filled by :meth:`resolve`; ``meta``'s tables are its views."""
    meta: AttentionMetadata
    sampling: SamplingTensors | None
    last_token_index: torch.Tensor | None
    """With prompt chunks: where each row's last token is, whose hidden state gives its logits."""
    max_logprobs: int | None = None
    """The most top log-probabilities a row asks for (None: no row wants log-probabilities)."""
    rope_lengths: torch.Tensor | None = None
    """For a model whose rotary embedding depends on the sequence length: each token's
    ``max(position + 1, prompt length)``; None where that is ``position + 1`` throughout."""
    padded_rows: int | None = None
    """A decode step padded to this many rows, its inputs at the addresses every step of that
    many rows uses (what a CUDA graph captured reads); None: not padded."""

    def resolve(self, last_sampled: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """The device work between the upload and the model: the rows' block tables gathered
        from ``block_table`` (the slots' device table) into ``meta``, and the step's input ids
        returned, the previous step's samples (``last_sampled``) taken in."""
        torch.index_select(block_table, 0, self.slots, out=self.block_tables)
        if self.sampled_from is None:
            return self.input_ids
        taken = last_sampled[self.sampled_from.clamp(min=0)]
        return torch.where(self.sampled_from >= 0, taken, self.input_ids)


@dataclass(slots=True)
class _TokenArrays:
    """A step's per-token and per-row arrays, built on the host, then uploaded in place; a
    padded decode step's are all set, in this order, before any optional one."""

    positions: np.ndarray  # first, at storage offset 0: compiled code guards on its inputs' offsets
    input_ids: np.ndarray
    sampled_from: np.ndarray | None
    slot_mapping: np.ndarray
    slots: np.ndarray
    context_lens: np.ndarray
    decode_order: np.ndarray
    """Longest first: a decode program that starts last should not be a long one."""
    rope_lengths: np.ndarray | None = None
    cu_seqlens_q: np.ndarray | None = None
    cu_seqlens_k: np.ndarray | None = None
    last_token_index: np.ndarray | None = None
    last_token_order: np.ndarray | None = None
    """With prompt chunks: every row, longest context first, as ``decode_order`` has the decode
    rows: the order the rows' last tokens are attended in (``AttentionMetadata.last_tokens``)."""


@dataclass(slots=True)
class _TableChanges:
    """Slots whose device block table is stale, and their host rows."""

    slots: np.ndarray
    tables: np.ndarray


_ROW_PADDING = {
    "positions": 0,
    "input_ids": 0,
    "sampled_from": -1,
    "slots": 0,
    **{f: AttentionMetadata.padding(f) for f in ("slot_mapping", "context_lens", "decode_order")},
}
"""A padding row's values: sample row -1 (token 0), slot 0, and the metadata's own padding (no
K/V stored, one key read)."""


def _pad_rows(arrays: _TokenArrays, rows: int) -> None:
    """Pad every per-row array of a decode step up to ``rows`` (:data:`_ROW_PADDING`)."""
    n = arrays.positions.shape[0]
    if rows < n:
        raise ValueError(f"cannot pad a decode step of {n} rows to {rows}")
    if arrays.sampled_from is None:  # a padded step always has it: its graph reads it
        arrays.sampled_from = np.full(n, -1, dtype=np.int64)
    if rows == n:
        return
    for name, value in _ROW_PADDING.items():
        a = getattr(arrays, name)
        setattr(arrays, name, np.concatenate((a, np.full(rows - n, value, dtype=a.dtype))))


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
        self._padded_upload: torch.Tensor | None = None
        self._padded_tables: torch.Tensor | None = None

    def build(self, batch: StepBatch, pad_to: int | None = None) -> StepInputs:
        """The step's inputs on the device. ``pad_to``: a decode step is padded to that many
        rows and uploaded into the padded steps' own buffer (``StepInputs.padded_rows``), unless
        it needs rope lengths."""
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
        k = len(batch.previous_sample_rows)
        input_ids = np.zeros(positions.shape[0], dtype=np.int64)
        input_ids[k:] = batch.token_ids
        sampled_from = None
        if k:
            sampled_from = np.full(positions.shape[0], -1, dtype=np.int64)
            sampled_from[:k] = batch.previous_sample_rows
        arrays = _TokenArrays(
            positions=positions,
            input_ids=input_ids,
            sampled_from=sampled_from,
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
        padded_rows = None
        if batch.is_decode and pad_to is not None and arrays.rope_lengths is None:
            padded_rows = pad_to
            _pad_rows(arrays, padded_rows)
        if not batch.is_decode:  # the prompt rows, after the single-token rows
            cu_k = np.zeros(n - d + 1, dtype=np.int32)
            np.cumsum(context_lens[d:], out=cu_k[1:])
            arrays.cu_seqlens_q = (cu_q[d:] - d).astype(np.int32)
            arrays.cu_seqlens_k = cu_k
            arrays.last_token_index = cu_q[1:] - 1
            arrays.last_token_order = np.argsort(-context_lens, kind="stable").astype(np.int32)
        sampling = max_logprobs = None
        if table.sampling is not None:
            prompt_lens = table.num_prompt_tokens[slots]
            sampling = table.sampling.gather(slots, context_lens - prompt_lens)
            sampling.processing = table.logits.gather(slots, context_lens, prompt_lens)
            max_logprobs = table.sampling.max_logprobs(slots)
        groups = [arrays]
        changes = None
        if stale_slots.size:
            changes = _TableChanges(stale_slots, table.block_tables.host[stale_slots])
            groups.append(changes)
        if sampling is not None:
            groups.append(sampling)
            if sampling.processing is not None:
                groups.append(sampling.processing)
        if padded_rows is None:
            upload(self.device, *groups)
            block_tables = torch.empty((n, table.block_tables.width), dtype=torch.int32, device=self.device)
        else:
            into, tables = self._padded_buffers()
            upload(self.device, *groups, into=into)
            block_tables = tables[:padded_rows]
        if changes is not None:
            table.block_tables.write_slots(changes.slots, changes.tables)
        if batch.is_decode:
            rows = (arrays.slot_mapping, arrays.context_lens, block_tables, context_lens, starts)
            meta = _decode_form(*rows, arrays.decode_order)
        else:
            meta = self._mixed_metadata(arrays, block_tables, d, starts, q_lens, context_lens)
        return StepInputs(
            arrays.input_ids,
            arrays.sampled_from,
            arrays.positions,
            arrays.slots,
            block_tables,
            meta,
            sampling,
            arrays.last_token_index,
            max_logprobs,
            arrays.rope_lengths,
            padded_rows,
        )

    def _padded_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The upload buffer of padded decode steps (room for ``max_num_seqs`` rows and a tail)
        and the block tables they gather into, made at the first such step."""
        if self._padded_upload is None:
            table = self.slot_table.block_tables
            rows = table.host.shape[0]
            # its per-row arrays, of at most 8 bytes a row, each 16-byte aligned
            size = len(_ROW_PADDING) * (rows * 8 + 16) + _PADDED_TAIL_BYTES
            self._padded_upload = torch.zeros(size, dtype=torch.uint8, device=self.device)
            self._padded_tables = torch.zeros((rows, table.width), dtype=torch.int32, device=self.device)
        return self._padded_upload, self._padded_tables

    @staticmethod
    def _mixed_metadata(arrays, block_tables, d, starts, q_lens, context_lens) -> AttentionMetadata:
        """Prompt rows described from row ``d`` on; the ``d`` single-token rows before them, if
        any, in a metadata of their own; every row's last token in another (``last_tokens``)."""
        every = (arrays.slot_mapping, arrays.context_lens, block_tables, context_lens, starts)
        decode = _decode_form(*(a[:d] for a in every), arrays.decode_order) if d else None
        last_tokens = _decode_form(*every, arrays.last_token_order)
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
            last_tokens=last_tokens,
        )


def _decode_form(slot_mapping, context_lens, block_tables, host_lens, starts, order) -> AttentionMetadata:
    """Rows as a decode step's metadata: one query each against its whole context (``host_lens``
    long, on the host; ``starts``: the tokens cached before the step), attended in ``order``.
    ``slot_mapping``: a decode row's one token each; for ``last_tokens`` (every row of a prompt
    step) the step's whole mapping, which the step has used already."""
    return AttentionMetadata(
        is_prefill=False,
        slot_mapping=slot_mapping,
        context_lens=context_lens,
        block_tables=block_tables,
        max_seqlen_k=int(host_lens.max()),
        has_prefix=bool(starts.any()),
        decode_order=order,
    )
