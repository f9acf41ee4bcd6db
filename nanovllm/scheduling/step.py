"""The typed boundary between scheduling and execution: what one step computes."""

from dataclasses import dataclass

from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling.sequence import Sequence


@dataclass(slots=True)
class NewRow:
    """A sequence that took a row (admitted, or readmitted after preemption): what the
    executor keeps for the row until another sequence takes it."""

    row: int
    num_prompt_tokens: int
    params: SamplingParams


@dataclass(slots=True)
class BlockTableUpdate:
    """Block ids a row gained: they go into its table from index ``start`` (0: a new table)."""

    row: int
    start: int
    block_ids: list[int]


@dataclass(slots=True)
class StepBatch:
    """One step's work as plain data, free of scheduler objects, so it can go to TP workers.

    Batch row ``i`` is the running sequence kept in executor row ``rows[i]``; it computes
    ``num_tokens[i]`` tokens from position ``start_positions[i]`` on, the last of which yields
    logits and a sampled token. ``token_ids`` holds every row's input tokens, concatenated.
    Per-row state the executor keeps between steps is sent only when it changes:
    ``new_rows`` (prompt length and sampling parameters) and ``block_table_updates``.
    With ``previous_sample_rows`` (a decode step planned while the previous one runs)
    ``token_ids`` is empty: row ``i``'s one input token is the one the previous step sampled
    in its batch row ``previous_sample_rows[i]``.
    """

    is_prefill: bool
    rows: list[int]
    num_tokens: list[int]
    token_ids: list[int]
    start_positions: list[int]
    new_rows: list[NewRow]
    block_table_updates: list[BlockTableUpdate]
    previous_sample_rows: list[int] | None = None

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(slots=True)
class ScheduledStep:
    """A step as the scheduler planned it: its sequences, and the batch sent to the executor."""

    seqs: list[Sequence]
    batch: StepBatch

    @property
    def is_prefill(self) -> bool:
        return self.batch.is_prefill

    @property
    def num_tokens(self) -> int:
        """Tokens this step computes."""
        return sum(self.batch.num_tokens)

    @classmethod
    def plan(cls, seqs: list[Sequence], is_prefill: bool) -> "ScheduledStep":
        """A step over the sequences' scheduled tokens, all of them known."""
        if is_prefill:
            token_ids: list[int] = []
            for s in seqs:
                start = s.num_computed_tokens
                token_ids += s.token_ids[start : start + s.num_scheduled_tokens]
            num_tokens = [s.num_scheduled_tokens for s in seqs]
        else:
            token_ids, num_tokens = [s.token_ids[-1] for s in seqs], [1] * len(seqs)
        starts = [s.num_computed_tokens for s in seqs]
        return cls._build(seqs, is_prefill, num_tokens, token_ids, starts, None)

    @classmethod
    def plan_after(cls, seqs: list[Sequence], in_flight: "ScheduledStep") -> "ScheduledStep":
        """The decode step after ``in_flight`` (a decode step), whose sampled tokens are not
        known yet: each row's input is its sequence's token in flight."""
        row_in_flight = {s.seq_id: i for i, s in enumerate(in_flight.seqs)}
        previous_rows = [row_in_flight[s.seq_id] for s in seqs]
        return cls._build(seqs, False, [1] * len(seqs), [], [len(s) for s in seqs], previous_rows)

    @classmethod
    def _build(
        cls,
        seqs: list[Sequence],
        is_prefill: bool,
        num_tokens: list[int],
        token_ids: list[int],
        start_positions: list[int],
        previous_sample_rows: list[int] | None,
    ) -> "ScheduledStep":
        new_rows, updates = [], []
        for s in seqs:  # send what the executor does not hold yet, once
            sent = s.num_blocks_sent
            if sent == 0:
                new_rows.append(NewRow(s.row, s.num_prompt_tokens, s.params))
            if len(s.block_table) > sent:
                updates.append(BlockTableUpdate(s.row, sent, s.block_table[sent:]))
                s.num_blocks_sent = len(s.block_table)
        batch = StepBatch(
            is_prefill=is_prefill,
            rows=[s.row for s in seqs],
            num_tokens=num_tokens,
            token_ids=token_ids,
            start_positions=start_positions,
            new_rows=new_rows,
            block_table_updates=updates,
            previous_sample_rows=previous_sample_rows,
        )
        return cls(seqs, batch)
