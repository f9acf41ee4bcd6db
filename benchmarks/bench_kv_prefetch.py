"""Does reading a small batch's K/V into L2 beside the layer's GEMMs shorten a decode step?

    PYTHONPATH=. python3 benchmarks/bench_kv_prefetch.py [--shape qwen3-0.6b] [--batches 1,4]

At batch 1-4 a decode layer is a chain of short, latency-bound launches, and decode attention
reads its few MiB at a quarter to a half of the copy rate. Nothing in attention waits on the
GEMMs but the query, so its K/V can be read into L2 earlier, on a side branch of the step's
CUDA graph, while weight-bound GEMMs run; attention then reads them from L2.

One graph holds ``--layers`` layers of one decode step, each with its own weights and cache:
the qkv GEMM, decode attention (the engine's kernel), the o, gate_up and down GEMMs and
SwiGLU (no norms, no prologue). Variants, microseconds a layer:

- ``serial``: the chain as the engine runs it;
- ``same``: a read of this layer's K/V forked at the layer's start, joined before its attention;
- ``next``: a read of the next layer's K/V forked after this layer's attention, joined before
  the next layer's attention;
- ``attention`` and ``no attention``: the chain's two parts alone, to read the overlap off.

The read loads with ``evict_last`` so the weights streaming past do not push it out of L2.
"""

import argparse
from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_decode_attention import graph_time_us

from nanovllm.demo_models import SHAPES
from nanovllm.kernels.decode_attention import paged_decode_attention
from nanovllm.kernels.silu_and_mul import silu_and_mul

BLOCK = 128  # the engine's default block size
_CHUNK = 8192  # elements of one cache block each read program covers


@triton.jit
def _read_kv_kernel(
    k_ptr, v_ptr, tables_ptr, ctx_ptr, sink_ptr, stride_block, stride_bt,
    BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    chunk, blk, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if blk * BLOCK_SIZE < tl.load(ctx_ptr + seq):
        block = tl.load(tables_ptr + seq * stride_bt + blk).to(tl.int64)
        offs = block * stride_block + chunk * CHUNK + tl.arange(0, CHUNK)
        k = tl.load(k_ptr + offs, eviction_policy="evict_last").to(tl.float32)
        v = tl.load(v_ptr + offs, eviction_policy="evict_last").to(tl.float32)
        # The sum's only use is a store that no reader looks at: it keeps the loads alive.
        programs = tl.num_programs(0) * tl.num_programs(1)
        tl.store(sink_ptr + seq * programs + blk * tl.num_programs(0) + chunk, tl.sum(k + v))


def read_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor, sink):
    """Load every cached block the rows' contexts cover (K and V), so they sit in L2."""
    block_elems = k_cache[0].numel()
    if block_elems % _CHUNK:
        raise ValueError(f"a cache block ({block_elems} elements) is not whole {_CHUNK}-element chunks")
    grid = (block_elems // _CHUNK, tables.shape[1], tables.shape[0])
    _read_kv_kernel[grid](
        k_cache, v_cache, tables, ctx, sink, k_cache.stride(0), tables.stride(0),
        BLOCK_SIZE=k_cache.shape[1], CHUNK=_CHUNK, num_warps=8,
    )  # fmt: skip


def build(shape: str, batch: int, context: int, layers: int, device: str = "cuda"):
    c = SHAPES[shape]
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
    hidden, heads, kv_heads, head_dim, inter = (c[key] for key in keys)
    qkv_out = (heads + 2 * kv_heads) * head_dim
    blocks_per_row = -(-context // BLOCK)
    num_blocks = batch * blocks_per_row
    dims = [(hidden, qkv_out), (heads * head_dim, hidden), (hidden, 2 * inter), (inter, hidden)]
    weights = [
        [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for k, n in dims]
        for _ in range(layers)
    ]
    caches = [
        tuple(
            torch.randn(num_blocks, BLOCK, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
            for _ in "kv"
        )
        for _ in range(layers)
    ]
    tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(batch, blocks_per_row)
    ctx = torch.full((batch,), context, device=device, dtype=torch.int32)
    x = torch.randn(batch, hidden, device=device, dtype=torch.bfloat16)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16)
    sink = torch.empty(batch * blocks_per_row * (BLOCK * kv_heads * head_dim // _CHUNK), device=device)
    return weights, caches, tables, ctx, x, q, sink


def step(weights, caches, tables, ctx, x, q, sink, mode: str, side: torch.cuda.Stream) -> None:
    """One decode step over every layer; ``mode`` as in the module docstring."""
    main = torch.cuda.current_stream()

    def fork_read(layer: int) -> None:
        side.wait_stream(main)
        with torch.cuda.stream(side):
            read_kv(*caches[layer], tables, ctx, sink)

    batch, heads, head_dim = q.shape
    for layer, (w_qkv, w_o, w_gate_up, w_down) in enumerate(weights):
        if mode == "same" or (mode == "next" and layer == 0):
            fork_read(layer)
        if mode != "attention":
            q = F.linear(x, w_qkv)[:, : heads * head_dim].reshape(batch, heads, head_dim)
        if mode in ("same", "next"):
            main.wait_stream(side)
        attn = (
            q
            if mode == "no attention"
            else paged_decode_attention(q, *caches[layer], tables, ctx, head_dim**-0.5)
        )
        if mode == "next" and layer + 1 < len(weights):
            fork_read(layer + 1)
        if mode != "attention":
            h = F.linear(attn.reshape(batch, -1), w_o)
            x = F.linear(silu_and_mul(F.linear(h, w_gate_up)), w_down)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's")
    parser.add_argument("--rep-ms", type=int, default=100)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    layers = args.layers or SHAPES[args.shape]["num_hidden_layers"]
    modes = ["serial", "same", "next", "attention", "no attention"]
    print(f"{args.shape}, {layers} layers a graph; us a layer")
    print(f"{'batch':>5} {'context':>7} " + " ".join(f"{m:>12}" for m in modes))
    side = torch.cuda.Stream()
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            inputs = build(args.shape, batch, context, layers)
            # One graph holds a whole step, so its time is divided by the layer count.
            times = [graph_time_us([partial(step, *inputs, m, side)], args.rep_ms) / layers for m in modes]
            print(f"{batch:>5} {context:>7} " + " ".join(f"{t:>12.1f}" for t in times), flush=True)
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
