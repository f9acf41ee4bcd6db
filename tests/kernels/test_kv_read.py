"""The K/V read of ``benchmarks/bench_kv_prefetch.py`` (interpreter on CPU, device on GPU):
every program must load exactly the cache chunk it names, and only for blocks a row's context
covers, or that benchmark would time reads of the wrong bytes."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tests.interpreter import DEVICE

pytestmark = pytest.mark.gpu

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def load_benchmark():
    sys.path.insert(0, str(BENCHMARKS))  # it imports bench_decode_attention's timer
    spec = importlib.util.spec_from_file_location("bench_kv_prefetch", BENCHMARKS / "bench_kv_prefetch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_read_covers_the_context_blocks_only():
    bench = load_benchmark()
    gen = torch.Generator().manual_seed(0)
    block_size, kv_heads, head_dim = 128, 2, 128
    k = torch.randn(7, block_size, kv_heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(7, block_size, kv_heads, head_dim, generator=gen).to(DEVICE)
    tables = torch.tensor([[3, 1, 5], [6, 0, 2]], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([300, 129], dtype=torch.int32, device=DEVICE)
    chunks = block_size * kv_heads * head_dim // bench._CHUNK
    sink = torch.full((2 * 3 * chunks,), float("nan"), device=DEVICE)
    bench.read_kv(k, v, tables, ctx, sink)
    sink = sink.view(2, 3, chunks).cpu()
    for row in range(2):
        for j in range(3):
            block = tables[row, j].item()
            if j * block_size < ctx[row]:
                want = (k[block] + v[block]).reshape(chunks, -1).sum(1).cpu()
                torch.testing.assert_close(sink[row, j], want, rtol=1e-4, atol=1e-3)
            else:
                assert torch.isnan(sink[row, j]).all(), "a block past the context was read"
