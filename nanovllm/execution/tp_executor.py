"""Drives one ModelRunner per tensor-parallel rank: rank 0 here, the rest in spawned workers.

Rank 0 writes each step into a shared-memory channel and wakes the workers; every rank then
runs the same step, meeting in the model's collectives. The ranks meet through a TCP store
on a port the system picks, and the channel has a random name, so several engines can live
on one machine. A step that fails on any rank leaves the others inside its collectives: the
step's error is raised, and the next step starts the workers again.
"""

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.config import Config
from nanovllm.execution import rpc
from nanovllm.execution.loader import Weights, plan_weight_update
from nanovllm.execution.model_runner import ModelRunner, PendingOutput
from nanovllm.execution.worker import Channel, connect_store, worker_main
from nanovllm.scheduling import StepBatch

logger = logging.getLogger("nanovllm")
START_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 5.0


@contextlib.contextmanager
def sigint_deferred():
    """Hold Ctrl-C until the block ends, so that no rank is left alone inside a collective."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, None)
            else:
                raise KeyboardInterrupt


def process_state(pid: int) -> str:
    """The kernel's one-letter state of a process ("T": stopped), or "" where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class TPExecutor:
    """The engine's executor (see ``nanovllm.engine.executor``) over ``tensor_parallel_size``
    ranks; with one rank it simply drives the local runner."""

    def __init__(self, config: Config):
        self.size = config.tensor_parallel_size
        # with several ranks, rank 0 broadcasts each step's samples (when async scheduling is on)
        self.supports_async_scheduling = True
        self.timeout_s = config.worker_timeout_s
        self.procs: list = []
        self.wakes: list = []
        self.channel: Channel | None = None
        self.store = None
        self.runner: ModelRunner | None = None
        self.broken = False
        self.num_calls = 0
        try:
            self._start(config)
            self.num_kvcache_blocks = self.runner.num_kvcache_blocks
            self.startup_seconds = dict(self.runner.startup_seconds)
            # the engine's configuration: max_model_len as the cache allows (restarts keep it)
            self.config = config.fit_max_model_len(self.num_kvcache_blocks)
        except BaseException:
            self.close()
            raise

    # --- start and stop ------------------------------------------------------------------
    def _start(self, config: Config) -> None:
        if self.size > 1:
            if dist.is_initialized():  # torch keeps one default process group per process
                raise ValueError(
                    "this process already drives a tensor-parallel engine; start another engine with "
                    "tensor_parallel_size > 1 in a separate process"
                )
            self.store = connect_store(0, self.size, self.timeout_s, is_master=True)
            self.channel = Channel(self.size - 1)
            ctx = mp.get_context("spawn")
            started = []
            for rank in range(1, self.size):
                wake, ready = ctx.Semaphore(0), ctx.Semaphore(0)
                args = (config, rank, self.store.port, self.channel.name, wake, ready, os.getpid())
                proc = ctx.Process(target=worker_main, args=args, daemon=True)
                proc.start()
                self.procs.append(proc)
                self.wakes.append(wake)
                started.append(ready)
            self._wait_started(started)
        try:
            self.runner = ModelRunner(config, 0, self.store)
        except BaseException:
            # no group existed when this start began: one now is the one rank 0 joined
            if self.size > 1 and dist.is_initialized():
                dist.destroy_process_group()
            raise

    def _wait_started(self, started: list) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (proc, ready) in enumerate(zip(self.procs, started), start=1):
            while not ready.acquire(timeout=0.05):
                if not proc.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel worker {rank} exited while starting (exit code {proc.exitcode}; "
                        "its error is printed above). Workers are spawned and import the main module "
                        'again: a script that creates an LLM needs an `if __name__ == "__main__":` guard'
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tensor-parallel worker {rank} did not start in {START_TIMEOUT_S:.0f} s"
                    )

    def _stop_workers(self, wait: bool) -> None:
        if self.procs and wait and self.channel is not None and all(p.is_alive() for p in self.procs):
            with contextlib.suppress(RuntimeError):
                self._wait_until_read()
                self._post("exit", ())
        deadline = time.monotonic() + (EXIT_TIMEOUT_S if wait else 0)
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs, self.wakes = [], []

    def close(self) -> None:
        """Stop the workers; free the model, KV cache, channel and process group. Idempotent."""
        self._stop_workers(wait=not self.broken)
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        if self.channel is not None:
            self.channel.close(unlink=True)
            self.channel = None
        self.store = None

    def _restart(self) -> None:
        logger.warning("nanovllm: starting the tensor-parallel workers again after a failed step")
        self.close()
        self.broken = False
        try:  # as many KV blocks as before: the engine's block manager counts on them
            self._start(replace(self.config, num_kvcache_blocks=self.num_kvcache_blocks))
        except BaseException:
            self.close()
            raise

    def recover(self) -> bool:
        """A failed step may have left workers inside its collectives: they are started again
        (with a fresh KV cache) at the next launch. Returns whether that will happen."""
        if self.runner is not None and self.runner.unsampled is not None:
            self.runner.unsampled = None
            if self.size > 1 and self.config.async_scheduling:  # workers wait for samples that never came
                self.broken = True
        return self.broken

    # --- one step --------------------------------------------------------------------------
    def _wait_until_read(self) -> None:
        """Wait until every worker has read the last command (a stopped one is reported)."""
        deadline = time.monotonic() + self.timeout_s
        while lagging := self.channel.lagging():
            self._raise_if_dead()
            if time.monotonic() > deadline:
                raise self._unresponsive(lagging[0] + 1)
            time.sleep(0.0002)

    def _post(self, method: str, args: tuple) -> None:
        """Write a command (every worker has read the last one) and wake the workers."""
        self.channel.write(method, args)
        for wake in self.wakes:
            wake.release()

    def _dead_worker(self) -> RuntimeError | None:
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                return RuntimeError(f"tensor-parallel worker {rank} died (exit code {proc.exitcode})")
        return None

    def _raise_if_dead(self) -> None:
        if error := self._dead_worker():
            raise error

    def _unresponsive(self, rank: int) -> RuntimeError:
        pid = self.procs[rank - 1].pid
        why = "is stopped (SIGSTOP?)" if process_state(pid) == "T" else "is hung"
        return RuntimeError(
            f"tensor-parallel worker {rank} (pid {pid}) {why}: no answer in {self.timeout_s:.0f} s "
            "(worker_timeout_s)"
        )

    def _explain(self, error: BaseException) -> BaseException:
        """The step's error, or what it really means when a worker died or stopped."""
        if not isinstance(error, Exception):
            return error
        if dead := self._dead_worker():
            return dead
        for rank, proc in enumerate(self.procs, start=1):
            if process_state(proc.pid) == "T":
                return self._unresponsive(rank)
        if "timed out" in str(error).lower():  # alive and running, yet silent
            who = "worker 1" if len(self.procs) == 1 else "a worker"
            return RuntimeError(
                f"tensor-parallel {who} is hung: no answer in a step's collective for "
                f"{self.timeout_s:.0f} s (worker_timeout_s)"
            )
        return error

    def launch(self, batch: StepBatch) -> PendingOutput:
        """Start one step on every rank; returns rank 0's handle on its output."""
        if self.runner is None:
            raise RuntimeError("this executor has been closed")
        if self.size == 1:
            return self.runner.launch(batch)
        if self.broken:
            self._restart()
        try:
            self._wait_until_read()
        except RuntimeError:
            self.broken = True
            raise
        # from here to the end of rank 0's part every rank must run the step: a Ctrl-C waits
        with sigint_deferred():
            try:
                self._post("launch", (batch,))
                return self.runner.launch(batch)
            except BaseException as error:
                self.broken = True
                explained = self._explain(error)
                if explained is error:
                    raise
                raise explained from error

    # --- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Weights) -> list[str]:
        """Copy ``(hf_name, tensor)`` pairs into the model on every rank, in place, after
        checking them all (``ValueError`` before anything is written); the names loaded."""
        if self.runner is None:
            raise RuntimeError("this executor has been closed")
        if self.size == 1:
            return self.runner.load_weights(weights)
        plan = plan_weight_update(self.runner.model, weights)
        entries = [(name, tuple(tensor.shape), tensor.dtype) for name, _, tensor in plan]
        if self.broken:
            self._restart()
        self._wait_until_read()
        with sigint_deferred():
            try:
                self._post("broadcast_weights", (entries,))
                self.runner.broadcast_weights(entries, [tensor for _, _, tensor in plan])
            except BaseException:
                self.broken = True
                raise
        return [name for name, _, _ in plan]

    # --- calls on every rank ---------------------------------------------------------------
    def collective_rpc(
        self,
        method: str | Callable,
        args: tuple = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """``method`` on every rank's :class:`ModelRunner` (a method's name, or a callable taking
        the runner first); the results in rank order. A rank's error raises ``RuntimeError``
        naming the rank; ``timeout`` (seconds, None: none) bounds the wait for the workers."""
        if self.runner is None:
            raise RuntimeError("this executor has been closed")
        kwargs = kwargs or {}
        if self.size == 1:
            return [rpc.run_call(self.runner, method, args, kwargs)]
        if self.broken:
            self._restart()
        call = rpc.encode_call(method, args, kwargs)
        self._wait_until_read()
        self.num_calls += 1
        call_id = self.num_calls
        with sigint_deferred():
            self._post("collective_rpc", (call_id, call))
            try:
                own = rpc.run_call(self.runner, method, args, kwargs)
            except BaseException:
                self._wait_for_results(call_id, timeout)  # the workers finish theirs first
                raise
        results = [own]
        for rank, data in enumerate(self._wait_for_results(call_id, timeout), start=1):
            results.append(rpc.decode_result(rank, data))
        return results

    def _wait_for_results(self, call_id: int, timeout: float | None) -> list[bytes]:
        keys = [rpc.result_key(call_id, rank) for rank in range(1, self.size)]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.store.check(keys):
            try:
                self._raise_if_dead()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"collective_rpc: the workers did not answer in {timeout} s")
            except BaseException:
                self.broken = True
                raise
            time.sleep(0.001)
        results = [self.store.get(key) for key in keys]
        for key in keys:
            self.store.delete_key(key)
        return results
