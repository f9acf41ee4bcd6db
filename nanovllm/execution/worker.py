"""Tensor-parallel worker processes and the shared-memory channel rank 0 drives them through."""

import gc
import os
import pickle
import signal
import struct
from datetime import timedelta
from multiprocessing.shared_memory import SharedMemory

import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.execution.rpc import result_key, run_encoded

CHANNEL_BYTES = 1 << 24
_SEQ_AND_SIZE = struct.Struct("<QI")
_ACK = struct.Struct("<Q")


class Channel:
    """One command at a time from rank 0 to every worker, in shared memory.

    The header holds the command's sequence number and size, then one acknowledgement per
    worker: the sequence number of the last command it read. Rank 0 writes a command only
    once every worker has read the previous one.
    """

    def __init__(self, num_workers: int, name: str | None = None):
        self.num_workers = num_workers
        self.header = _SEQ_AND_SIZE.size + _ACK.size * num_workers
        self.shm = SharedMemory(name=name, create=name is None, size=CHANNEL_BYTES if name is None else 0)
        self.seq = 0

    @property
    def name(self) -> str:
        return self.shm.name

    def write(self, method: str, args: tuple) -> None:
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        if self.header + len(data) > CHANNEL_BYTES:
            raise RuntimeError(f"a step of {len(data)} bytes exceeds the {CHANNEL_BYTES}-byte worker channel")
        self.shm.buf[self.header : self.header + len(data)] = data
        self.seq += 1
        _SEQ_AND_SIZE.pack_into(self.shm.buf, 0, self.seq, len(data))

    def read(self, worker: int) -> tuple[str, tuple]:
        seq, size = _SEQ_AND_SIZE.unpack_from(self.shm.buf, 0)
        method, args = pickle.loads(self.shm.buf[self.header : self.header + size])
        _ACK.pack_into(self.shm.buf, _SEQ_AND_SIZE.size + _ACK.size * worker, seq)
        return method, args

    def lagging(self) -> list[int]:
        """Workers (0-based) that have not read the last command yet."""
        offsets = (_SEQ_AND_SIZE.size + _ACK.size * w for w in range(self.num_workers))
        return [w for w, off in enumerate(offsets) if _ACK.unpack_from(self.shm.buf, off)[0] != self.seq]

    def close(self, unlink: bool) -> None:
        self.shm.close()
        if unlink:
            self.shm.unlink()


def connect_store(port: int, world_size: int, timeout_s: float, is_master: bool) -> dist.TCPStore:
    """The rendezvous of one engine's ranks, on a port the system picked (0 for rank 0)."""
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=is_master,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


def worker_main(
    config: Config, rank: int, store_port: int, channel_name: str, wake, started, parent_pid: int
):
    """Rank ``rank``: run the commands rank 0 writes until told to exit or rank 0's process is
    gone. Ctrl-C is ignored: the driver owns shutdown. ``wake`` and ``started`` are semaphores,
    whose release never blocks: a stopped peer cannot hold a lock the other side needs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from nanovllm.execution.model_runner import ModelRunner

    started.release()
    channel = Channel(config.tensor_parallel_size - 1, channel_name)
    store = connect_store(store_port, config.tensor_parallel_size, config.worker_timeout_s, is_master=False)
    runner = ModelRunner(config, rank, store)
    gc.collect()  # as the driver does after start-up (nanovllm/llm.py): no full walk mid-run
    gc.freeze()
    try:
        while True:
            while not wake.acquire(timeout=0.5):
                if os.getppid() != parent_pid:
                    return  # the driver died; nobody will send "exit"
            method, args = channel.read(rank - 1)
            if method == "exit":
                return
            if method == "collective_rpc":
                call_id, call = args
                store.set(result_key(call_id, rank), run_encoded(runner, call))
                continue
            getattr(runner, method)(*args)
    finally:
        runner.close()
        channel.close(unlink=False)
