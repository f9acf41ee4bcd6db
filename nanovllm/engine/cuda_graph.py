"""CUDA graphs for decode: a ladder of batch sizes sharing one memory pool."""

from typing import TYPE_CHECKING

import torch

from nanovllm.attention import AttentionMetadata

if TYPE_CHECKING:
    from nanovllm.engine.model_runner import ModelRunner


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, and ``max_num_seqs`` itself."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    """Captures the decode forward per batch size; replays the smallest that fits a batch.

    Inputs are copied into static buffers; rows past the real batch are padding whose KV
    writes are skipped (slot -1) and whose outputs are dropped.
    """

    def __init__(self, runner: "ModelRunner", max_num_seqs: int, max_blocks_per_seq: int):
        self.model = runner.model
        self.batch_sizes = batch_size_ladder(max_num_seqs)
        self.max_batch_size = self.batch_sizes[-1]
        device, n = runner.device, self.max_batch_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        with torch.inference_mode():
            for bs in reversed(self.batch_sizes):  # largest first, so smaller ones reuse its pool
                self._capture(bs)
        torch.cuda.synchronize()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slot_mapping[:bs],
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs],
        )

    def _capture(self, bs: int) -> None:
        args = (self.input_ids[:bs], self.positions[:bs], self._meta(bs))
        self.model(*args)  # warm-up: compiles kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            self.outputs[bs] = self.model(*args)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[bs] = graph

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = next(b for b in self.batch_sizes if b >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:bs] = -1
        self.context_lens[:n] = meta.context_lens
        self.context_lens[n:bs] = 1
        # stale entries from an earlier, longer batch must not survive past this batch's tables
        self.block_tables[:bs].zero_()
        self.block_tables[:n, : meta.block_tables.shape[1]] = meta.block_tables
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

    def close(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
