"""A request's state as it moves through the scheduler."""

from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids of one request plus the bookkeeping the scheduler and KV cache need.

    ``num_computed_tokens`` counts tokens whose KV is already in the cache (cache hits
    included); the step in flight computes ``num_scheduled_tokens`` more.
    """

    __slots__ = (
        "seq_id",
        "status",
        "token_ids",
        "last_token",
        "num_tokens",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_scheduled_tokens",
        "num_cached_tokens",
        "block_table",
        "num_hashed_blocks",
        "params",
        "finish_reason",
    )
    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams) -> None:
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.last_token = self.token_ids[-1]
        self.num_tokens = self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0
        self.params = params
        self.finish_reason: str | None = None

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_prefilling(self) -> bool:
        """True while more than the last token still lacks KV (prompt chunks or recompute)."""
        return self.num_computed_tokens < self.num_tokens - 1

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1
