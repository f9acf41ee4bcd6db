"""Drives one ModelRunner per tensor-parallel rank: rank 0 here, the rest in spawned workers.

Rank 0 pickles each call into a shared-memory buffer and wakes the workers with one event
each; every rank then runs the same step, meeting in the model's collectives. The buffer
has a random name and the process group meets through a temporary file, so several engines
can live on one machine.
"""

import os
import pickle
import struct
import tempfile
from multiprocessing.shared_memory import SharedMemory

import torch.multiprocessing as mp

from nanovllm.config import Config
from nanovllm.execution.model_runner import ModelRunner, SampledTokens
from nanovllm.scheduling import StepBatch

SHM_BYTES = 1 << 24


def _worker_main(config: Config, rank: int, init_method: str, shm_name: str, event) -> None:
    runner = ModelRunner(config, rank, init_method)
    shm = SharedMemory(name=shm_name)
    try:
        while True:
            event.wait()
            (size,) = struct.unpack_from("<I", shm.buf, 0)
            method, args = pickle.loads(shm.buf[4 : 4 + size])
            event.clear()
            if method == "exit":
                break
            getattr(runner, method)(*args)
    finally:
        runner.close()
        shm.close()


class TPExecutor:
    """The engine's executor: one :class:`ModelRunner` per rank, driven from this process."""

    def __init__(self, config: Config):
        self.size = config.tensor_parallel_size
        # only rank 0 holds the sampled tokens a step planned ahead would read
        self.supports_async_scheduling = self.size == 1
        self.shm = None
        self.procs: list = []
        self.events: list = []
        self.init_file = None
        init_method = None
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                raise ValueError(
                    "this process already drives a tensor-parallel engine; start another engine with "
                    "tensor_parallel_size > 1 in a separate process"
                )
            fd, self.init_file = tempfile.mkstemp(prefix="nanovllm-dist-")
            os.close(fd)
            os.unlink(self.init_file)  # the file store creates it
            init_method = f"file://{self.init_file}"
            self.shm = SharedMemory(create=True, size=SHM_BYTES)
            ctx = mp.get_context("spawn")
            for rank in range(1, self.size):
                event = ctx.Event()
                proc = ctx.Process(
                    target=_worker_main, args=(config, rank, init_method, self.shm.name, event), daemon=True
                )
                proc.start()
                self.procs.append(proc)
                self.events.append(event)
        try:
            self.runner = ModelRunner(config, 0, init_method)
        except BaseException:
            self.close()
            raise
        self.num_kvcache_blocks = self.runner.num_kvcache_blocks

    def _check_workers(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel worker {rank} died (exit code {proc.exitcode})")

    def launch(self, batch: StepBatch) -> SampledTokens:
        """Start one step on every rank; returns rank 0's handle on its sampled tokens."""
        return self._call("launch", batch)

    def _call(self, method: str, *args):
        """Run ``method`` on every rank; returns rank 0's result."""
        if self.procs:
            self._check_workers()
            data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
            if len(data) + 4 > SHM_BYTES:
                raise RuntimeError(f"step of {len(data)} bytes exceeds the {SHM_BYTES}-byte worker buffer")
            struct.pack_into("<I", self.shm.buf, 0, len(data))
            self.shm.buf[4 : 4 + len(data)] = data
            for event in self.events:
                event.set()
        try:
            return getattr(self.runner, method)(*args)
        except Exception:
            self._check_workers()
            raise

    def close(self) -> None:
        """Stop the workers and release shared memory, graphs and the process group."""
        if self.procs:
            alive = [p for p in self.procs if p.is_alive()]
            if alive and self.shm is not None:
                data = pickle.dumps(("exit", ()))
                struct.pack_into("<I", self.shm.buf, 0, len(data))
                self.shm.buf[4 : 4 + len(data)] = data
                for event in self.events:
                    event.set()
            for proc in self.procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            self.procs = []
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()
            self.runner = None
        if self.shm is not None:
            self.shm.close()
            self.shm.unlink()
            self.shm = None
        if self.init_file and os.path.exists(self.init_file):
            os.unlink(self.init_file)
        self.init_file = None
