"""TFLOP/s of prefill attention on long causal prompts, against a bf16 GEMM's in the same run.

Run from the project root: ``PYTHONPATH=. python3 benchmarks/bench_prefill_attention.py``.
Our paged kernel (K/V from the cache), which the Triton backend runs for prompts after a cached
prefix and for most others; with no prefix, also torch's varlen attention (K/V from the step
itself) where it exists and cuDNN's (``nanovllm/attention/cudnn_prefill.py``) on Hopper.
FLOPs count what causal attention must do: 4 * heads * head_dim * (new * prefix + new**2 / 2)
per sequence.

``--sweep`` times the paged kernel at each launch of ``SWEEP`` instead (tile rows, keys per
tile, warps, stages) on the 8B heads' long prompts, each output checked against the engine's
launch first: whether the engine's launch is still the best one.
"""

import argparse
import itertools
from functools import partial
from unittest import mock

import torch
from triton.testing import do_bench

from nanovllm.attention.cudnn_prefill import cudnn_causal_prefill, cudnn_prefill_supported
from nanovllm.attention.triton_backend import _find_varlen_attn
from nanovllm.kernels import prefill_attention
from nanovllm.kernels.prefill_attention import PrefillLaunch, paged_prefill_attention

SHAPES = {"qwen3-0.6b": (16, 8, 128), "qwen3-8b": (32, 8, 128)}  # heads, KV heads, head_dim
DTYPE, BLOCK = torch.bfloat16, 256
SWEEP = list(itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4)))  # block_m, block_n, warps, stages


def gemm_tflops(rep_ms: int) -> float:
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    b = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    ms = do_bench(lambda: a @ b, rep=rep_ms, return_mode="median")
    return 2 * 8192**3 / ms / 1e9


def attention_flops(heads: int, head_dim: int, prefix: int, new: int, batch: int) -> float:
    return batch * 4 * heads * head_dim * (new * prefix + new * new / 2)


def bench(shape: str, batch: int, prefix: int, new: int, rep_ms: int) -> list[tuple[str, float]]:
    """TFLOP/s of our paged kernel and, with no prefix, of torch's varlen flash attention and
    cuDNN's (one call a sequence, as the Triton backend makes them on Hopper)."""
    heads, kv_heads, head_dim = SHAPES[shape]
    q = torch.randn(batch * new, heads, head_dim, dtype=DTYPE, device="cuda")
    cu_q = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    flops = attention_flops(heads, head_dim, prefix, new, batch)
    results = []
    if prefix == 0:
        k = torch.randn(batch * new, kv_heads, head_dim, dtype=DTYPE, device="cuda")
        v = torch.randn_like(k)
        varlen = _find_varlen_attn()
        if varlen is None:
            results.append(("varlen (missing)", float("nan")))
        else:
            ms = do_bench(
                lambda: varlen(q, k, v, cu_q, cu_q, new, new, scale=scale, enable_gqa=True), rep=rep_ms
            )
            results.append(("varlen flash", flops / ms / 1e9))
        if cudnn_prefill_supported(q.device):
            ms = do_bench(lambda: cudnn_causal_prefill(q, k, v, (new,) * batch, scale), rep=rep_ms)
            results.append(("cuDNN", flops / ms / 1e9))
    blocks_per_seq = -(-(prefix + new) // BLOCK)
    shape4 = (batch * blocks_per_seq, BLOCK, kv_heads, head_dim)
    k_cache = torch.randn(shape4, dtype=DTYPE, device="cuda")
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(batch * blocks_per_seq, device="cuda", dtype=torch.int32)
    tables = perm.view(batch, blocks_per_seq)
    ctx = torch.full((batch,), prefix + new, dtype=torch.int32, device="cuda")
    ms = do_bench(
        lambda: paged_prefill_attention(q, k_cache, v_cache, cu_q, ctx, tables, scale, new), rep=rep_ms
    )
    results.append(("paged Triton", flops / ms / 1e9))
    return results


def sweep(rep_ms: int, peak: float) -> None:
    """TFLOP/s of the paged kernel at every launch of ``SWEEP``, 8B heads, no prefix."""
    heads, kv_heads, head_dim = SHAPES["qwen3-8b"]
    for batch, new in ((1, 8192), (1, 16384), (4, 4096), (1, 1536)):
        q = torch.randn(batch * new, heads, head_dim, dtype=DTYPE, device="cuda")
        cu_q = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device="cuda")
        blocks_per_seq = -(-new // BLOCK)
        k_cache = torch.randn(batch * blocks_per_seq, BLOCK, kv_heads, head_dim, dtype=DTYPE, device="cuda")
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(batch * blocks_per_seq, device="cuda", dtype=torch.int32).view(batch, -1)
        ctx = torch.full((batch,), new, dtype=torch.int32, device="cuda")
        args = (q, k_cache, v_cache, cu_q, ctx, tables, head_dim**-0.5, new)
        expected = paged_prefill_attention(*args)
        flops = attention_flops(heads, head_dim, 0, new, batch)
        results = []
        for block_m, block_n, warps, stages in SWEEP:
            launch = PrefillLaunch(block_m, block_n, stages, warps, False)
            with mock.patch.object(prefill_attention, "launch_settings", return_value=launch):
                try:
                    got = paged_prefill_attention(*args)
                except Exception as e:  # e.g. out of shared memory
                    print(f"  {launch}: {type(e).__name__}")
                    continue
                if not torch.allclose(got, expected, atol=2e-2, rtol=2e-2):
                    print(f"  {launch}: WRONG OUTPUT")
                    continue
                ms = do_bench(partial(paged_prefill_attention, *args), rep=rep_ms)
            results.append((flops / ms / 1e9, launch))
        results.sort(key=lambda r: -r[0])
        print(f"8B heads, {batch} x {new}: best of {len(results)} launches")
        for tflops, b in results[:6]:
            tile = f"m{b.block_m} n{b.block_n} w{b.num_warps} s{b.num_stages}"
            print(f"  {tflops:5.0f} TFLOP/s {100 * tflops / peak:3.0f}%  {tile}")
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing")
    parser.add_argument("--sweep", action="store_true", help="the paged kernel's launches, 8B heads")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    rep_ms = 50 if args.quick else 200
    peak = gemm_tflops(rep_ms)
    print(f"{torch.cuda.get_device_name()}: bf16 GEMM 8192^3 at {peak:.0f} TFLOP/s")
    if args.sweep:
        return sweep(rep_ms, peak)
    print(f"{'shape':>10} {'batch':>5} {'prefix':>6} {'new':>6} {'path':>16} {'TFLOP/s':>8} {'% GEMM':>6}")
    cases = [(4, 0, 4096), (1, 0, 16384), (1, 0, 1536), (4, 4096, 1024), (1, 8192, 4096)]
    for shape in SHAPES:
        for batch, prefix, new in cases[:2] if args.quick else cases:
            for path, tflops in bench(shape, batch, prefix, new, rep_ms):
                print(
                    f"{shape:>10} {batch:>5} {prefix:>6} {new:>6} {path:>16} {tflops:>8.0f} "
                    f"{100 * tflops / peak:>5.0f}%"
                )
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
