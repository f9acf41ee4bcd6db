"""The benchmarks' CUDA graphs: kernels timed as a decode step runs them, replayed from one graph
(no launch overhead from Python, which costs more than a small decode kernel takes on the GPU)."""

from collections.abc import Callable

import torch
from triton.testing import do_bench


def capture(*fns: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fns`` captured in one graph, in order, after a call of the first outside it (Triton
    compiles and cuBLAS picks its algorithm there, which capture does not allow)."""
    fns[0]()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph


def graph_us(fns: list[Callable[[], object]], rep_ms: int) -> float:
    """Median microseconds per call of ``fns`` replayed as one graph (do_bench clears the L2 cache
    before each replay)."""
    return do_bench(capture(*fns).replay, rep=rep_ms, return_mode="median") * 1e3 / len(fns)


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Milliseconds per replay of ``graph``, ``reps`` back to back after one more."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps
