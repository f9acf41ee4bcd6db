"""The typed boundary between scheduling and execution: what one step computes."""

from dataclasses import dataclass

from nanovllm.scheduling.sequence import Sequence


@dataclass(slots=True)
class StepBatch:
    """One step's work as plain data, free of scheduler objects, so it can go to TP workers.

    Batch row ``i`` is the running sequence kept in executor row ``rows[i]``; it computes
    ``token_ids[i]`` at positions ``start_positions[i]`` onward, and the last of them yields
    logits and a sampled token. The executor keeps each row's block table between steps:
    this step writes ``new_block_ids[i]`` into it from index ``block_table_starts[i]`` (0: the
    row starts afresh). With ``previous_sample_rows`` (a decode step planned while the
    previous one runs) every ``token_ids[i]`` is empty: row ``i``'s one input token is the
    one the previous step sampled in its batch row ``previous_sample_rows[i]``.
    """

    is_prefill: bool
    rows: list[int]
    token_ids: list[list[int]]
    start_positions: list[int]
    block_table_starts: list[int]
    new_block_ids: list[list[int]]
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    min_ps: list[float]
    seeds: list[int | None]
    steps: list[int]
    """Tokens each row has generated before this step's: with ``seeds``, what a draw depends on."""
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
        return sum(map(len, self.batch.token_ids)) if self.batch.is_prefill else len(self.seqs)

    @classmethod
    def plan(cls, seqs: list[Sequence], is_prefill: bool) -> "ScheduledStep":
        """A step over the sequences' scheduled tokens, all of them known."""
        token_ids = (
            [
                s.token_ids[s.num_computed_tokens : s.num_computed_tokens + s.num_scheduled_tokens]
                for s in seqs
            ]
            if is_prefill
            else [[s.token_ids[-1]] for s in seqs]
        )
        return cls._build(seqs, is_prefill, token_ids, [s.num_computed_tokens for s in seqs], 0, None)

    @classmethod
    def plan_after(cls, seqs: list[Sequence], in_flight: "ScheduledStep") -> "ScheduledStep":
        """The decode step after ``in_flight`` (a decode step), whose sampled tokens are not
        known yet: each row's input is its sequence's token in flight."""
        row_in_flight = {s.seq_id: i for i, s in enumerate(in_flight.seqs)}
        previous_rows = [row_in_flight[s.seq_id] for s in seqs]
        return cls._build(seqs, False, [[] for _ in seqs], [len(s) for s in seqs], 1, previous_rows)

    @classmethod
    def _build(
        cls,
        seqs: list[Sequence],
        is_prefill: bool,
        token_ids: list[list[int]],
        start_positions: list[int],
        tokens_in_flight: int,
        previous_sample_rows: list[int] | None,
    ) -> "ScheduledStep":
        starts, new_blocks = [], []
        for s in seqs:  # send each block id once: the executor keeps the rest
            starts.append(s.num_blocks_sent)
            new_blocks.append(s.block_table[s.num_blocks_sent :])
            s.num_blocks_sent = len(s.block_table)
        params = [s.params for s in seqs]
        batch = StepBatch(
            is_prefill=is_prefill,
            rows=[s.row for s in seqs],
            token_ids=token_ids,
            start_positions=start_positions,
            block_table_starts=starts,
            new_block_ids=new_blocks,
            temperatures=[p.temperature for p in params],
            top_ks=[p.top_k for p in params],
            top_ps=[p.top_p for p in params],
            min_ps=[p.min_p for p in params],
            seeds=[p.seed for p in params],
            steps=[s.num_completion_tokens + tokens_in_flight for s in seqs],
            previous_sample_rows=previous_sample_rows,
        )
        return cls(seqs, batch)
