"""The typed boundary between scheduling and execution: what one step computes."""

from dataclasses import dataclass, field

from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling.sequence import Sequence


@dataclass(slots=True)
class NewRow:
    """A sequence that took a row (admitted, or readmitted after preemption): what the
    executor keeps for the row until another sequence takes it."""

    row: int
    num_prompt_tokens: int
    params: SamplingParams
    token_ids: list[int] | None = None
    """Every token id the sequence has (prompt, then any generated before a preemption), sent
    only when its params penalise repeats: the executor may not see cached prompt tokens."""


@dataclass(slots=True)
class BlockTableUpdate:
    """Block ids a row gained: they go into its table from index ``start`` (0: a new table)."""

    row: int
    start: int
    block_ids: list[int]


@dataclass(slots=True)
class PromptLogprobsRow:
    """Batch row ``batch_row`` asks for the log-probabilities of ``target_ids``, the prompt
    tokens that its first ``len(target_ids)`` input tokens predict, and for its top ``k``."""

    batch_row: int
    target_ids: list[int]
    k: int


@dataclass(slots=True)
class StepBatch:
    """One step's work as plain data, free of scheduler objects, so it can go to TP workers.

    Batch row ``i`` is the running sequence kept in executor row ``rows[i]``; it computes
    ``num_tokens[i]`` tokens from position ``start_positions[i]`` on, the last of which yields
    logits and a sampled token. The first ``num_decode_rows`` rows compute one token each
    (decodes); the rest are prompt chunks, so a step may mix both. The first
    ``len(previous_sample_rows)`` rows take their one input token from the previous step's
    samples (a step planned before those are read back): row ``i``'s is the one sampled in
    that step's batch row ``previous_sample_rows[i]``. ``token_ids`` holds the input tokens of
    the other rows, concatenated. Per-row state the executor keeps between steps is sent only
    when it changes: ``new_rows`` (prompt length and sampling parameters) and
    ``block_table_updates``.
    """

    rows: list[int]
    num_tokens: list[int]
    token_ids: list[int]
    start_positions: list[int]
    num_decode_rows: int
    new_rows: list[NewRow]
    block_table_updates: list[BlockTableUpdate]
    previous_sample_rows: list[int] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobsRow] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def is_decode(self) -> bool:
        """Every row computes one token: the shape CUDA graphs are captured for."""
        return self.num_decode_rows == len(self.rows)


@dataclass(slots=True)
class ScheduledStep:
    """A step as the scheduler planned it: its sequences, and the batch sent to the executor."""

    seqs: list[Sequence]
    batch: StepBatch

    @property
    def is_decode(self) -> bool:
        return self.batch.is_decode

    @property
    def num_tokens(self) -> int:
        """Tokens this step computes."""
        return sum(self.batch.num_tokens)

    @classmethod
    def plan(
        cls,
        from_previous: list[tuple[Sequence, int]],
        decodes: list[Sequence],
        chunks: list[tuple[Sequence, int, int]],
    ) -> "ScheduledStep":
        """A step of ``from_previous`` rows ``(seq, row in the step in flight)``, whose input is
        the token in flight; of ``decodes``, whose input is their last token; and of prompt
        ``chunks`` ``(seq, start, num_tokens)``. Rows of one token go first."""
        single = [c for c in chunks if c[2] == 1]
        if single:
            chunks = single + [c for c in chunks if c[2] > 1]
        seqs = [s for s, _ in from_previous] + decodes + [s for s, _, _ in chunks]
        token_ids = [s.token_ids[-1] for s in decodes]
        for s, start, n in chunks:
            token_ids += s.token_ids[start : start + n]
        new_rows, updates = [], []
        for s in seqs:  # send what the executor does not hold yet, once
            sent = s.num_blocks_sent
            if sent == 0:
                history = list(s.token_ids) if s.params.penalizes_repeats else None
                new_rows.append(NewRow(s.row, s.num_prompt_tokens, s.params, history))
            if len(s.block_table) > sent:
                updates.append(BlockTableUpdate(s.row, sent, s.block_table[sent:]))
                s.num_blocks_sent = len(s.block_table)
        num_single = len(from_previous) + len(decodes) + len(single)
        prompt_logprobs = []
        for j, (s, start, n) in enumerate(chunks, start=len(from_previous) + len(decodes)):
            if s.params.prompt_logprobs is not None and start + 1 < s.num_prompt_tokens:
                targets = s.token_ids[start + 1 : min(start + n + 1, s.num_prompt_tokens)]
                prompt_logprobs.append(PromptLogprobsRow(j, targets, s.params.prompt_logprobs))
        batch = StepBatch(
            rows=[s.row for s in seqs],
            num_tokens=[1] * num_single + [n for _, _, n in chunks[len(single) :]],
            token_ids=token_ids,
            start_positions=[len(s.token_ids) for s, _ in from_previous]
            + [len(s.token_ids) - 1 for s in decodes]
            + [start for _, start, _ in chunks],
            num_decode_rows=num_single,
            new_rows=new_rows,
            block_table_updates=updates,
            previous_sample_rows=[row for _, row in from_previous],
            prompt_logprobs=prompt_logprobs,
        )
        return cls(seqs, batch)
