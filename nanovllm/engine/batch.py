"""The typed boundary between scheduling and execution: what one step computes."""

from dataclasses import dataclass

from nanovllm.engine.sequence import Sequence


@dataclass(slots=True)
class StepBatch:
    """One step's work, free of scheduler objects so it can be sent to TP workers.

    Sequence ``i`` computes ``token_ids[i]`` at positions ``start_positions[i]`` onward,
    with its KV blocks in ``block_tables[i]``; the last computed token of every sequence
    yields logits and a sampled token. With ``tokens_from_previous`` (a decode step planned
    while the previous one runs) each ``token_ids[i]`` is ``[row]``: the input is the token
    that the previous step sampled for that row.
    """

    is_prefill: bool
    token_ids: list[list[int]]
    start_positions: list[int]
    block_tables: list[list[int]]
    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    min_ps: list[float]
    seeds: list[int | None]
    steps: list[int]
    tokens_from_previous: bool = False

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], is_prefill: bool) -> "StepBatch":
        if is_prefill:
            token_ids = [
                seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + seq.num_scheduled_tokens]
                for seq in seqs
            ]
        else:
            token_ids = [[seq.last_token] for seq in seqs]
        return cls._build(seqs, is_prefill, token_ids, [seq.num_computed_tokens for seq in seqs], 0)

    @classmethod
    def ahead_of(cls, seqs: list[Sequence], in_flight: list[Sequence]) -> "StepBatch":
        """The decode step after ``in_flight``, whose sampled tokens are not known yet."""
        rows = {seq.seq_id: i for i, seq in enumerate(in_flight)}
        token_ids = [[rows[seq.seq_id]] for seq in seqs]
        batch = cls._build(seqs, False, token_ids, [seq.num_tokens for seq in seqs], 1)
        batch.tokens_from_previous = True
        return batch

    @classmethod
    def _build(
        cls,
        seqs: list[Sequence],
        is_prefill: bool,
        token_ids: list[list[int]],
        start_positions: list[int],
        tokens_in_flight: int,
    ) -> "StepBatch":
        params = [seq.params for seq in seqs]
        return cls(
            is_prefill=is_prefill,
            token_ids=token_ids,
            start_positions=start_positions,
            block_tables=[seq.block_table for seq in seqs],
            temperatures=[p.temperature for p in params],
            top_ks=[p.top_k for p in params],
            top_ps=[p.top_p for p in params],
            min_ps=[p.min_p for p in params],
            seeds=[p.seed for p in params],
            steps=[seq.num_completion_tokens + tokens_in_flight for seq in seqs],
        )
