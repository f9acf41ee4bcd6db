"""Calls that act on the engine's model and memory between generate calls, as vLLM's and as RL
trainers use them: calls on every worker, weights updated in place, the prefix cache reset,
sleep mode."""

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from nanovllm.config import SLEEP_TAGS


class EngineControls:
    """A mix-in of :class:`~nanovllm.engine.llm_engine.LLMEngine`: it reads the engine's
    ``executor``, ``scheduler``, ``config``, ``busy`` lock and ``is_finished``, and owns
    ``asleep``."""

    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list[Any]:
        """vLLM's: ``method`` on every tensor-parallel rank's worker (a ``ModelRunner``), as the
        name of one of its methods or a callable taking it first (a lambda too: it travels by
        value); the results in rank order. A rank's error raises naming the rank. Runs between
        calls, not while one runs, nor while a part of the engine sleeps."""
        if self.executor is None:
            raise RuntimeError("this engine has been shut down")
        with self._idle("collective_rpc"):
            self._check_awake("collective_rpc")
            return self.executor.collective_rpc(method, args, kwargs, timeout)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> list[str]:
        """Update the model in place from ``(hf_name, tensor)`` pairs (Hugging Face names, as
        ``named_parameters()`` or a state dict's ``items()`` give them; tensors on the CPU or the
        engine's device), on every tensor-parallel rank through the start-up loaders (packed
        q/k/v and gate/up, experts, shards; a tied head's copy is skipped). The pairs are read
        whole and checked first: an unknown name, a wrong shape or dtype raises ``ValueError``
        naming it, with nothing written. Then they are copied one at a time, and cached prefixes
        are dropped. Returns the names loaded."""
        if self.executor is None:
            raise RuntimeError("this engine has been shut down")
        with self._idle("load_weights"):
            self._check_awake("load_weights", needs=("weights",))
            loaded = self.executor.load_weights(list(weights))
            self.scheduler.forget_cached_prefixes()
        return loaded

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's); False, changing nothing, while requests run."""
        if not self.busy.acquire(blocking=False):
            return False
        try:
            if not self.is_finished():
                return False
            self.scheduler.forget_cached_prefixes()
            return True
        finally:
            self.busy.release()

    @contextlib.contextmanager
    def _idle(self, what: str) -> Iterator[None]:
        """Hold the engine for ``what``, which needs no request running."""
        if not self.busy.acquire(blocking=False):
            raise RuntimeError(f"{what}: the engine is running a call (a generate, or a stream not yet read)")
        try:
            if not self.is_finished():
                raise RuntimeError(f"{what}: requests queued with add_request are still running")
            yield
        finally:
            self.busy.release()

    # --- sleep mode ------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (``enable_sleep_mode=True``): free every rank's device memory
        between calls, say while an RL trainer trains beside the engine. Level 1: the weights
        go to CPU memory and come back as they were; level 2: they are dropped, to be loaded
        again (:meth:`load_weights`) after :meth:`wake_up`. Both free the KV cache, whose cached
        prefixes are forgotten, and the CUDA graphs. Until every part is woken, calls that run
        the model raise ``RuntimeError``."""
        if not self.config.enable_sleep_mode:
            raise RuntimeError("sleep mode is off: create the LLM with enable_sleep_mode=True")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {level!r}")
        if self.executor is None:
            raise RuntimeError("this engine has been shut down")
        with self._idle("sleep"):
            # marked first: after a rank fails part way, wake_up restores whatever it freed
            self.asleep.update(SLEEP_TAGS)
            self.scheduler.forget_cached_prefixes()
            self.executor.collective_rpc("sleep", args=(level,))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what :meth:`sleep` freed: everything (``tags`` None), or the parts named:
        "weights" (their device memory, holding the weights of before a level-1 sleep; after a
        level-2 one, nothing yet: load them) and "kv_cache" (as many blocks as before, empty).
        CUDA graphs are captured again once both are back. Parts awake are left as they are."""
        if self.executor is None:
            raise RuntimeError("this engine has been shut down")
        tags = list(SLEEP_TAGS) if tags is None else [tags] if isinstance(tags, str) else list(tags)
        unknown = [tag for tag in tags if tag not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"wake_up tags {unknown} are unknown: the tags are {list(SLEEP_TAGS)}")
        with self._idle("wake_up"):
            if self.asleep.intersection(tags):
                self.executor.collective_rpc("wake_up", args=(tags,))
                self.asleep.difference_update(tags)

    def is_sleeping(self) -> bool:
        """Whether a part of the engine sleeps (from :meth:`sleep` until every part is woken)."""
        return bool(self.asleep)

    def _check_awake(self, what: str, needs: tuple[str, ...] = SLEEP_TAGS) -> None:
        """Raise naming what to wake when a part ``what`` needs sleeps (by default: any part)."""
        if not self.asleep:
            return
        parts = [tag for tag in SLEEP_TAGS if tag in self.asleep and tag in needs]
        if parts:
            raise RuntimeError(
                f"{what}: the engine is asleep ({' and '.join(parts)} freed by sleep): "
                f"call wake_up() or wake_up(tags={parts}) first"
            )
