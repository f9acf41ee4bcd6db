"""The synthetic steps a runner takes before serving: the profile's full-budget prefill, the
warm-up's step shapes and the decode graphs' example batch (zero tokens, every block id 0)."""

from nanovllm.config import Config
from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling.step import BlockTableUpdate, NewSlot, StepBatch


def prompt_rows(tokens: int, config: Config) -> list[int]:
    """Prompt lengths summing to ``tokens`` (at most ``max_model_len`` each, at most
    ``max_num_seqs`` of them: fewer tokens where those bounds say so)."""
    max_len = config.max_model_len
    lens = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
    return lens[: config.max_num_seqs]


def warm_up_lens(config: Config) -> list[tuple[list[int], int]]:
    """``(prompt lengths, cached prefix)`` of the eager steps that compile, before the first
    request waits for it, what eager steps run: prompt chunks with and without a cached prefix,
    alone and mixed with decodes; a step of one token (kernels that take another path for a
    step's few tokens, as the MoE alignment does); then a step of every power of two from 64
    tokens below the largest step (the profile's: the token budget, as far as ``max_num_seqs``
    rows of ``max_model_len`` hold it), since kernels pick tiles and split factors by a step's
    token count and each pick compiles once."""
    n = max(1, min(16, config.max_model_len // 2))
    rows = config.max_num_seqs
    steps = [(lens[-rows:], prefix) for prefix in (0, n) for lens in ([n, n], [1, 1, n])]
    steps.append(([1], 0))
    tokens, largest = 64, sum(prompt_rows(config.max_num_batched_tokens, config))
    while tokens < largest:
        steps.append((prompt_rows(tokens, config), 0))
        tokens *= 2
    return steps


def dummy_batch(lens: list[int], block_size: int, prefix: int = 0, new_slots: bool = True) -> StepBatch:
    """Slots 0.. computing ``lens`` zero tokens after ``prefix`` cached ones, every block id 0,
    sampled at temperature 1; rows of one token go first. ``new_slots=False``: the slots' tables
    and sampling are those an earlier dummy batch of as many rows or more set up."""
    lens = sorted(lens, key=lambda n: n > 1)
    set_up = list(range(len(lens))) if new_slots else []
    params = SamplingParams(temperature=1.0)  # one for all rows: checking each costs ~10 us
    return StepBatch(
        slots=list(range(len(lens))),
        num_tokens=lens,
        token_ids=[0] * sum(lens),
        start_positions=[prefix] * len(lens),
        num_single_token_rows=lens.count(1),
        new_slots=[NewSlot(slot, prefix + lens[slot], params) for slot in set_up],
        block_table_updates=[
            BlockTableUpdate(slot, 0, [0] * -(-(prefix + lens[slot]) // block_size)) for slot in set_up
        ],
    )
