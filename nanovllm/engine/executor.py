"""What the engine asks of whatever runs the model: the whole orchestration/execution boundary."""

from typing import Protocol

from nanovllm.scheduling import StepBatch


class SampledTokens(Protocol):
    """A launched step's sampled token ids, one per batch row."""

    def tolist(self) -> list[int]:
        """Wait for the step and return its tokens."""
        ...

    def logprobs(self) -> list[tuple[float, list[int], list[float]]] | None:
        """After :meth:`tolist`, when a row of the step asked for log-probabilities: per row,
        the sampled token's, and the ids and log-probabilities of the batch's top-k tokens."""
        ...

    def prompt_logprobs(self) -> list[tuple[float, list[int], list[float]]] | None:
        """After :meth:`tolist`, when the step's batch has ``prompt_logprobs`` rows: the same
        for each of their target prompt tokens, in order."""
        ...


class Executor(Protocol):
    """Runs steps on the model; built by the caller and handed to the engine."""

    num_kvcache_blocks: int
    """KV blocks the cache holds: the block manager hands out exactly these."""
    supports_async_scheduling: bool
    """Whether a step may take its input tokens from the previous step's samples
    (``StepBatch.previous_sample_rows``) before they are read back."""

    def launch(self, batch: StepBatch) -> SampledTokens:
        """Start one step; steps run in launch order."""
        ...

    def recover(self) -> bool:
        """After a step failed or was interrupted: make the next launch start from a consistent
        state on every rank. Returns True when the KV cache's contents are lost by it, so that
        cached prefixes must be forgotten."""
        ...

    def close(self) -> None:
        """Stop workers and free device memory. Idempotent."""
        ...
