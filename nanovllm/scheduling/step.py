"""The typed boundary between scheduling and execution: what one step computes, and what it
returns. Plain data, no scheduler objects, so a step can travel to tensor-parallel workers.

Words: a *slot* is the persistent index (one of ``max_num_seqs``) under which the executor keeps
a running sequence's state from step to step; a *row* is an index into one step's batch.
"""

from dataclasses import dataclass, field

from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling.sequence import Sequence


@dataclass(slots=True)
class NewSlot:
    """A sequence took ``slot`` (admitted, or readmitted after preemption): what the executor
    keeps for the slot until another sequence takes it."""

    slot: int
    num_prompt_tokens: int
    params: SamplingParams
    token_ids: list[int] | None = None
    """Every token id the sequence has (prompt, then any generated before a preemption), sent
    only when its params read them (``needs_token_history``): the executor may not see cached
    prompt tokens."""


@dataclass(slots=True)
class BlockTableUpdate:
    """Block ids a slot gained: they go into its table from index ``start`` (0: a new table)."""

    slot: int
    start: int
    block_ids: list[int]


@dataclass(slots=True)
class PromptLogprobsRequest:
    """Row ``row`` asks for the log-probabilities of ``target_ids``, the prompt tokens that its
    first ``len(target_ids)`` input tokens predict (the first is prompt token
    ``first_position``), and for its top ``k``."""

    row: int
    first_position: int
    target_ids: list[int]
    k: int


@dataclass(slots=True)
class StepBatch:
    """One step's work.

    Row ``i`` is the running sequence kept in slot ``slots[i]``; it computes ``num_tokens[i]``
    tokens from position ``start_positions[i]`` on, the last of which yields logits and a
    sampled token. The first ``num_single_token_rows`` rows compute one token each (decodes,
    and prompt chunks of one token); the rest are longer prompt chunks, so a step may mix both.
    The first ``len(previous_sample_rows)`` rows take their one input token from the previous
    step's samples (a step planned before those are read back): row ``i``'s is the one sampled
    in the previous step's row ``previous_sample_rows[i]``. ``token_ids`` holds the input tokens
    of the other rows, concatenated. Per-slot state the executor keeps between steps is sent
    only when it changes: ``new_slots`` and ``block_table_updates``.
    """

    slots: list[int]
    num_tokens: list[int]
    token_ids: list[int]
    start_positions: list[int]
    num_single_token_rows: int
    new_slots: list[NewSlot]
    block_table_updates: list[BlockTableUpdate]
    previous_sample_rows: list[int] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobsRequest] = field(default_factory=list)
    structured_rows: list[int] = field(default_factory=list)
    """Rows sampled under a structured-output constraint: their sampling waits for the step's
    token bitmask (``PendingOutput.sample_with_bitmask``), one bitmask row each, in order."""

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def is_decode(self) -> bool:
        """Every row computes one token: the shape CUDA graphs are captured for."""
        return self.num_single_token_rows == len(self.slots)


@dataclass(slots=True)
class ScheduledStep:
    """A step as the scheduler planned it: its sequences (one per row) and the batch sent to
    the executor. Rows ``[0, num_decodes)`` decode (their input is the sequence's newest
    token); the others compute prompt tokens (or recompute a preempted sequence's)."""

    seqs: list[Sequence]
    batch: StepBatch
    num_decodes: int


@dataclass(slots=True)
class TokenLogprobs:
    """The log-probability of one chosen (or prompt) token and its rank (1: the most likely),
    and the ids and log-probabilities of the most likely tokens at its position, most likely
    first."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


NO_TOKEN = -1
"""A sampled id meaning: the row's request allows no token here (every logit masked)."""
NOT_FINITE = -2
"""A sampled id meaning: the model's logits for the row are NaN or infinite."""


@dataclass(slots=True)
class StepOutput:
    """What a step returns: one sampled token per row (a prompt chunk's is meaningless, a
    negative one is :data:`NO_TOKEN` or :data:`NOT_FINITE`), and log-probabilities where the
    batch asked for them."""

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    """One per row, when a row of the step asked for log-probabilities."""
    prompt_logprobs: list[list[TokenLogprobs]] | None = None
    """One list per ``StepBatch.prompt_logprobs`` request, in order, one entry per target."""
