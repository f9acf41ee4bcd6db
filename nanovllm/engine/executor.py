"""What the engine asks of whatever runs the model: the whole orchestration/execution boundary."""

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from nanovllm.scheduling import StepBatch, StepOutput


class PendingOutput(Protocol):
    """A launched step, whose output is read back when asked for."""

    def bitmask_buffer(self, rows: int) -> np.ndarray:
        """A writable int32 array ``[rows, ceil(vocab / 32)]`` to fill and hand to
        :meth:`sample_with_bitmask` (on a GPU, pinned host memory the upload reads as it is)."""
        ...

    def sample_with_bitmask(self, bitmask: np.ndarray) -> None:
        """Sample a step with ``structured_rows``: ``bitmask`` (int32, one row per structured
        row, bit ``t % 32`` of word ``t // 32`` allowing token ``t``) masks their logits first.
        Due once, before :meth:`result` and before the next launch."""
        ...

    def result(self) -> StepOutput:
        """Wait for the step and return its output."""
        ...


class Executor(Protocol):
    """Runs steps on the model; built by the caller and handed to the engine."""

    num_kvcache_blocks: int
    """KV blocks the cache holds: the block manager hands out exactly these."""
    startup_seconds: dict[str, float]
    """Where the start-up went, phase by phase (rank 0's; see ``ModelRunner.startup_seconds``)."""
    supports_async_scheduling: bool
    """Whether a step may take its input tokens from the previous step's samples
    (``StepBatch.previous_sample_rows``) before they are read back."""

    def launch(self, batch: StepBatch) -> PendingOutput:
        """Start one step; steps run in launch order."""
        ...

    def load_weights(self, weights: list[tuple[str, Any]]) -> list[str]:
        """Copy ``(hf_name, tensor)`` pairs into the model in place on every rank, after checking
        every one (``ValueError`` naming the bad ones before anything is written); returns the
        names loaded."""
        ...

    def collective_rpc(
        self,
        method: str | Callable,
        args: tuple = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """``method`` (a method name, or a callable taking the rank's runner first) on every
        rank; the results in rank order."""
        ...

    def recover(self) -> bool:
        """After a step failed or was interrupted: make the next launch start from a consistent
        state on every rank. Returns True when the KV cache's contents are lost by it, so that
        cached prefixes must be forgotten."""
        ...

    def close(self) -> None:
        """Stop workers and free device memory. Idempotent."""
        ...
