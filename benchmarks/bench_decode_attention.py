"""Effective bandwidth of the Triton paged decode attention against a device-to-device copy.

Run from the project root: ``PYTHONPATH=. python3 benchmarks/bench_decode_attention.py [--quick]``.
Bandwidth counts the K and V bytes the kernel must read: sum(context_lens) * num_kv_heads *
head_dim * 2 * the cache dtype's size (``--kv-cache-dtype fp8``: one byte). The copy counts
bytes read plus bytes written.

Timed as a decode step runs it: one CUDA graph holds the call for up to ``--layers`` layers,
each reading a cache of its own (so no layer finds another's K/V in L2), and the time is per
call. A graph's own launch cost is then spread over its layers, as in the engine.

``--floor`` adds, per case, torch's ``sum`` over a buffer of the same K/V bytes timed the same
way: one well-tuned read-only launch per layer, the floor a small batch's attention (which
must also combine its splits) can approach. ``--vllm`` adds vLLM's FlashAttention 3 on the same
16-bit caches, queries and block tables (vLLM installed; its own split heuristics), timed alike.
"""

import argparse
import itertools
from functools import partial

import torch
from triton.testing import do_bench

from benchmarks.cuda_graphs import graph_us
from nanovllm.kernels.decode_attention import default_num_splits, paged_decode_attention
from nanovllm.kernels.device import num_sms
from nanovllm.kernels.kv_layout import KVLayout

HEAD_DIM = 128
DTYPE = torch.bfloat16
MAX_CACHE_BYTES = 40e9


def copy_bandwidth(num_bytes: int, rep_ms: int) -> float:
    """GB/s of ``dst.copy_(src)``, counting read + write."""
    src = torch.empty(num_bytes // 2, dtype=DTYPE, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), rep=rep_ms, return_mode="median")
    return 2 * num_bytes / ms / 1e6


def bench_decode(
    batch: int,
    context: int,
    block_size: int,
    rep_ms: int,
    cache_dtype: torch.dtype,
    layers: int,
    heads: tuple[int, int],
    num_splits: int | None = None,
    vllm: bool = False,
) -> tuple[float, int, float | None]:
    """Median microseconds of one layer's decode attention with every sequence at ``context``
    tokens and ``heads`` (query, KV) heads, over ``layers`` layers of one graph, and its splits
    (``num_splits``, default the engine's own)."""
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    num_heads, num_kv_heads = heads
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)

    def cache() -> torch.Tensor:
        return torch.randn(shape, dtype=DTYPE, device="cuda").to(cache_dtype)

    layout = KVLayout.for_dtype(cache_dtype)  # the engine's, for this dtype
    caches = [(cache(), layout.v_view(cache())) for _ in range(layers)]
    # Shuffled blocks, as a real cache fragments over time.
    perm = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    tables = perm.view(batch, blocks_per_seq)
    ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, num_heads, HEAD_DIM, dtype=DTYPE, device="cuda")
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, blocks_per_seq, block_size, num_sms(q.device))
    calls = [
        partial(paged_decode_attention, q, k, v, tables, ctx, HEAD_DIM**-0.5, num_splits, layout=layout)
        for k, v in caches
    ]
    theirs = None
    if vllm:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        fa3 = partial(
            flash_attn_varlen_func, q, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=context,
            seqused_k=ctx, softmax_scale=HEAD_DIM**-0.5, causal=True, block_table=tables, fa_version=3,
        )  # fmt: skip
        theirs = graph_us([partial(fa3, k=k, v=v) for k, v in caches], rep_ms)
    return graph_us(calls, rep_ms), num_splits, theirs


def read_floor_us(num_bytes: int, rep_ms: int, layers: int) -> float:
    """Median microseconds per layer of ``sum`` over ``num_bytes`` (a buffer per layer)."""
    bufs = [torch.empty(num_bytes // 2, dtype=DTYPE, device="cuda").normal_() for _ in range(layers)]
    return graph_us([partial(torch.sum, b, dtype=torch.float32) for b in bufs], rep_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--layers", type=int, default=28, help="layers (caches) per graph, at most")
    parser.add_argument("--floor", action="store_true", help="also time a sum over the same bytes")
    parser.add_argument("--batches", default=None, help="comma-separated (default 1,16,256)")
    parser.add_argument("--heads", default="16/8", help="query/KV heads (Qwen3-8B: 32/8, 30B-A3B: 32/4)")
    parser.add_argument("--contexts", default=None, help="comma-separated (default 512,2048,8192,32768)")
    parser.add_argument("--splits", default="0", help="comma-separated split counts; 0: the engine's own")
    parser.add_argument(
        "--vllm", action="store_true", help="also time vLLM's FlashAttention 3 (16-bit caches)"
    )
    args = parser.parse_args()
    num_heads, num_kv_heads = heads = tuple(map(int, args.heads.split("/")))
    cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else DTYPE
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    rep_ms = 50 if args.quick else 200
    batches = [1, 256] if args.quick else [1, 16, 256]
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    contexts = [2048, 32768] if args.quick else [512, 2048, 8192, 32768]
    if args.contexts:
        contexts = [int(c) for c in args.contexts.split(",")]
    split_counts = [int(n) or None for n in args.splits.split(",")]
    block_sizes = [128] if args.quick else [128, 16]  # the engine's default, and a small one
    dtype_bytes = torch.finfo(cache_dtype).bits // 8

    copy_gbs = copy_bandwidth(4 * 2**30, rep_ms)
    print(f"{torch.cuda.get_device_name()}: device copy {copy_gbs:.0f} GB/s (read + write)")
    print(f"{num_heads}/{num_kv_heads} heads")
    vllm = args.vllm and cache_dtype == DTYPE
    extra_head = f" {'sum us':>7} {'% copy':>6}" if args.floor else ""
    extra_head += f" {'FA3 us':>7} {'% copy':>6}" if vllm else ""
    print(
        f"{'batch':>5} {'context':>7} {'block':>5} {'splits':>6} {'time us':>9} {'GB/s':>7} {'% copy':>6}"
        + extra_head
    )
    for block_size, batch, context, num_splits in itertools.product(
        block_sizes, batches, contexts, split_counts
    ):
        kv_bytes = batch * context * num_kv_heads * HEAD_DIM * 2 * dtype_bytes
        if kv_bytes > MAX_CACHE_BYTES:
            continue
        layers = max(1, min(args.layers, int(MAX_CACHE_BYTES // kv_bytes)))
        us, splits, fa3_us = bench_decode(
            batch, context, block_size, rep_ms, cache_dtype, layers, heads, num_splits, vllm
        )
        gbs = kv_bytes / us / 1e3
        extra = ""  # the optional columns: the read floor, vLLM's FA3
        if args.floor:
            floor_us = read_floor_us(kv_bytes, rep_ms, layers)
            extra = f" {floor_us:>7.1f} {100 * kv_bytes / floor_us / 1e3 / copy_gbs:>5.0f}%"
        if fa3_us is not None:
            extra += f" {fa3_us:>7.1f} {100 * kv_bytes / fa3_us / 1e3 / copy_gbs:>5.0f}%"
        print(
            f"{batch:>5} {context:>7} {block_size:>5} {splits:>6} {us:>9.1f} "
            f"{gbs:>7.0f} {100 * gbs / copy_gbs:>5.0f}%" + extra
        )
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
