"""CUDA graphs for decode: a ladder of batch sizes sharing one memory pool."""

from collections.abc import Callable

import torch

DecodeForward = Callable[[], torch.Tensor]


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, and ``max_num_seqs`` itself."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """A CUDA graph of the decode step's forward pass at each ladder batch size; a step runs on
    the smallest that holds it.

    ``prepare(bs)`` readies a step of ``bs`` rows (its inputs uploaded where every step of
    ``bs`` rows puts them) and returns the forward pass over those inputs, which is captured:
    a later step of at most ``bs`` rows, padded to ``bs`` and uploaded there, replays it.
    ``capture=False`` keeps the forward passes and calls them at replay instead: the same fixed
    inputs and padding without a GPU, for tests.
    """

    def __init__(self, prepare: Callable[[int], DecodeForward], max_num_seqs: int, capture: bool = True):
        self.batch_sizes = batch_size_ladder(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.uncaptured: dict[int, DecodeForward] = {}
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.batch_sizes):  # largest first, so smaller ones reuse its pool
                forward = prepare(bs)
                if not capture:
                    self.uncaptured[bs] = forward
                    continue
                forward()  # warm-up: compiles kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.outputs[bs] = forward()
                pool = graph.pool() if pool is None else pool
                self.graphs[bs] = graph
        if capture:
            torch.cuda.synchronize()

    def padded_size(self, num_rows: int) -> int | None:
        """The batch size a decode step of ``num_rows`` rows replays at; None past the largest."""
        return next((b for b in self.batch_sizes if b >= num_rows), None)

    def replay(self, batch_size: int) -> torch.Tensor:
        """Run the graph of ``batch_size`` rows on what its inputs hold now; its output rows."""
        if self.uncaptured:
            return self.uncaptured[batch_size]()
        self.graphs[batch_size].replay()
        return self.outputs[batch_size]

    def close(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.uncaptured.clear()
