"""CUDA graphs for decode: a ladder of batch sizes sharing one memory pool."""

from collections.abc import Callable

import torch

from nanovllm.attention import AttentionMetadata

DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, and ``max_num_seqs`` itself."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """Captures ``forward`` on decode batches of each ladder size; replays the smallest that
    fits a batch.

    ``example`` is a decode batch of the largest size; its metadata becomes the static
    buffers the graphs read. A batch is copied into them, and the rows past it are padded
    with the values :class:`AttentionMetadata` declares (no KV stored, one key attended), so a
    new metadata field needs no change here. Input ids and positions of padding rows keep
    stale (valid) values.
    """

    def __init__(
        self,
        forward: DecodeForward,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        example: AttentionMetadata,
        max_num_seqs: int,
    ):
        self.batch_sizes = batch_size_ladder(max_num_seqs)
        if input_ids.shape[0] != self.batch_sizes[-1]:
            raise ValueError(f"the example batch has {input_ids.shape[0]} rows, not {self.batch_sizes[-1]}")
        self.input_ids, self.positions = input_ids.clone(), positions.clone()
        self.meta = example.static_copy()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.batch_sizes):  # largest first, so smaller ones reuse its pool
                args = (self.input_ids[:bs], self.positions[:bs], self.meta.first_rows(bs))
                forward(*args)  # warm-up: compiles kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self.outputs[bs] = forward(*args)
                pool = graph.pool() if pool is None else pool
                self.graphs[bs] = graph
        torch.cuda.synchronize()

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = next(b for b in self.batch_sizes if b >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.meta.copy_rows_from(meta, bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

    def close(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
