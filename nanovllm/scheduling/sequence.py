"""A request's state as it moves through the scheduler."""

from enum import Enum, auto

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids of one completion plus the bookkeeping the scheduler and KV cache need.

    The :class:`~nanovllm.scheduling.BlockManager` owns ``block_table``, ``block_hashes`` (the
    chained hash of each full block of ``token_ids``, computed once) and ``num_shared_blocks``;
    the :class:`~nanovllm.scheduling.Scheduler` owns everything else. ``num_computed_tokens``
    counts tokens whose KV is in the cache (cache hits included) once the steps that computed
    them have returned.
    """

    __slots__ = (
        "seq_id",
        "status",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_table",
        "block_hashes",
        "num_shared_blocks",
        "slot",
        "num_blocks_sent",
        "params",
        "finish_reason",
        "stop_reason",
        "prompt_source",
        "request_id",
    )

    def __init__(
        self, seq_id: int, token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        """The request this completion belongs to, for messages."""
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.num_shared_blocks = 0
        """Leading blocks of ``block_table`` registered in the prefix cache."""
        self.slot = -1
        """The executor slot holding this sequence's state while it runs; -1 otherwise."""
        self.num_blocks_sent = 0
        """Entries of ``block_table`` that the executor has already been sent."""
        self.params = params
        self.finish_reason: str | None = None
        """"stop", "length" or "abort" once finished."""
        self.stop_reason: int | str | None = None
        """The stop token id or stop string that ended it (None for EOS and length)."""
        self.prompt_source: Sequence | None = None
        """The sibling (of ``n`` parallel samples) whose computed prompt this one reuses."""

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
