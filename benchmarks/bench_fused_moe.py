"""TFLOP/s of the fused MoE kernels at Qwen3-30B-A3B's expert shape (CUDA only); with ``--sweep``
the tiles that fit each token count best.

Run from the project root: ``PYTHONPATH=. python3 benchmarks/bench_fused_moe.py [--experts
bf16|fp8-row|fp8-block] [--sweep] [--loop]``. Shape: hidden 2048, moe_intermediate 768, 128
experts, top-8, bf16 activations; the experts in bf16, in e4m3 with one scale per row
(``quantization="fp8"``) or by 128 x 128 blocks (an FP8 checkpoint's). FLOPs count the routed
work, 6 * hidden * inter per (token, expert) pair; at few tokens the layer is bound by the expert
weights it reads, so their bandwidth (GB/s of distinct experts' weights) is shown too. The fused
kernels run as a CUDA-graph replay (as decode steps run them: GPU time, no launch overhead).
``--loop`` adds the per-expert torch reference, eagerly (it syncs with the host; float64 products
for e4m3 experts). ``--sweep`` times every candidate tile at each token count, and for e4m3 experts
with per-row scales the default tiles with each K step summed apart (``FAST_ACCUM=False``); a tile
whose output differs from the default tiles' beyond the GEMMs' rounding is reported and skipped.
``--vllm`` times vLLM's Triton ``fused_experts`` beside ours on the same routing and weights, as
vLLM runs ``quantization="fp8"`` experts (e4m3 with one scale per expert, activations rounded to
e4m3 per tensor on the fly) or bf16 ones: vLLM installed, its own tiles, also a graph replay.
``--align`` times the routing's grouping by expert alone (``moe_align``, 48 calls a graph, as a
decode step of the 48 layers runs it): the one-program kernel against the three launches.
"""

import argparse
import functools
import itertools
import json

import torch
from triton.testing import do_bench

from benchmarks.cuda_graphs import capture, graph_us
from nanovllm.kernels.fused_moe import fused_moe, fused_moe_config, fused_moe_ref
from nanovllm.kernels.moe_align import moe_align
from nanovllm.layers.fused_moe import quantize_blocks, quantize_rows

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
DTYPE = torch.bfloat16
DEVICE = "cuda"


def bf16_experts() -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=DTYPE, device=DEVICE) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, dtype=DTYPE, device=DEVICE) / INTER**0.5
    return w13, w2


def make_experts(kind: str, w13: torch.Tensor, w2: torch.Tensor) -> dict:
    """The experts' ``fused_moe`` arguments: ``w13``, ``w2`` and, for e4m3, their scales."""
    if kind == "bf16":
        return dict(w13=w13, w2=w2)
    if kind == "fp8-row":
        (q13, s13), (q2, s2) = quantize_rows(w13), quantize_rows(w2)
    else:  # gate and up each by 128 x 128 blocks, as an FP8 checkpoint stores them
        (q13, s13), (q2, s2) = quantize_blocks(w13, 2), quantize_blocks(w2, 1)
    return dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)


def routing(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, HIDDEN, dtype=DTYPE, device=DEVICE)
    logits = torch.randn(tokens, EXPERTS, device=DEVICE)
    topk_weights, topk_ids = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
    return x, (topk_weights / topk_weights.sum(-1, keepdim=True)).to(DTYPE), topk_ids


def rates(tokens: int, ids: torch.Tensor, experts: dict, ms: float) -> str:
    flops = 6 * HIDDEN * INTER * tokens * TOP_K
    weight_bytes = len(ids.unique()) * 3 * HIDDEN * INTER * experts["w13"].element_size()
    return f"{ms * 1e3:>9.1f} us {flops / ms / 1e9:>7.2f} TFLOP/s {weight_bytes / ms / 1e6:>7.0f} GB/s"


def per_expert_e4m3(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[experts, rows, cols]`` in e4m3 with one scale per expert (vLLM's online FP8)."""
    scale = w.abs().float().amax(dim=(1, 2)) / torch.finfo(torch.float8_e4m3fn).max
    return (w.float() / scale[:, None, None]).to(torch.float8_e4m3fn), scale


def vllm_experts(kind: str, w13: torch.Tensor, w2: torch.Tensor):
    """``run(x, weights, ids)``: vLLM's Triton experts on these weights, as its ``quantization="fp8"``
    holds them (e4m3, one scale per expert) unless ``kind`` is bf16."""
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts_impl

    if kind == "bf16":
        return lambda x, weights, ids: fused_experts_impl(x, w13, w2, weights, ids)
    (q13, s13), (q2, s2) = per_expert_e4m3(w13), per_expert_e4m3(w2)
    return lambda x, weights, ids: fused_experts_impl(
        x, q13, q2, weights, ids, use_fp8_w8a8=True, w1_scale=s13, w2_scale=s2
    )


def bench(tokens: int, rep_ms: int, experts: dict, loop: bool, vllm=None, config: dict | None = None) -> None:
    x, weights, ids = routing(tokens)
    fused = capture(lambda: fused_moe(x, topk_weights=weights, topk_ids=ids, config=config, **experts)).replay
    row = [f"{tokens:>6}", rates(tokens, ids, experts, do_bench(fused, rep=rep_ms, return_mode="median"))]
    if vllm is not None:
        ours = fused_moe(x, topk_weights=weights, topk_ids=ids, **experts).float()
        err = (vllm(x, weights, ids).float() - ours).abs().max().item() / ours.abs().max().item()
        theirs = capture(lambda: vllm(x, weights, ids)).replay
        row += [
            "vLLM " + rates(tokens, ids, experts, do_bench(theirs, rep=rep_ms, return_mode="median")),
            f"max |diff| / max |ours| {err:.2e}",
        ]
    if loop:
        got = fused_moe(x, topk_weights=weights, topk_ids=ids, **experts)
        ref = lambda: fused_moe_ref(x, topk_weights=weights, topk_ids=ids, **experts)  # noqa: E731
        err = (got.float() - ref().float()).abs().max().item()
        row += [
            rates(tokens, ids, experts, do_bench(ref, rep=rep_ms, return_mode="median")),
            f"max |diff| {err:.2e}",
        ]
    print(" | ".join(row), flush=True)


def bench_align(tokens: int, rep_ms: int, kind: str) -> None:
    _, _, ids = routing(tokens)
    dtype = DTYPE if kind == "bf16" else torch.float8_e4m3fn
    block_m = fused_moe_config(tokens * TOP_K, EXPERTS, dtype)["BLOCK_M"]
    one, three = (
        graph_us([functools.partial(moe_align, ids, EXPERTS, block_m, one_program=form)] * 48, rep_ms)
        for form in (True, False)
    )
    print(f"{tokens:>6} | BLOCK_M {block_m:>3} | one program {one:6.2f} us | three launches {three:6.2f} us")


def candidates(kind: str, per_expert: float) -> list[dict]:
    """The sweep's tiles: ``BLOCK_M`` around the pairs an expert gets, wider K steps for e4m3."""
    block_ms = [16, 32] if per_expert <= 48 else [64, 128]
    block_ks = [128, 256] if kind == "fp8-row" else [64, 128]  # block scales: a step in one group
    tiles = itertools.product(block_ms, [64, 128], block_ks, [4, 8], [3, 4])
    return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s) for m, n, k, w, s in tiles]


def sweep(tokens: int, rep_ms: int, kind: str, experts: dict) -> None:
    x, weights, ids = routing(tokens)
    run = lambda cfg: fused_moe(x, topk_weights=weights, topk_ids=ids, config=cfg, **experts)  # noqa: E731
    default = fused_moe_config(tokens * TOP_K, EXPERTS, experts["w13"].dtype, kind == "fp8-block")
    want = run(None).float()
    tol = 3e-2 * want.abs().max().item()  # bf16 roundings of gate, up, silu, down
    configs = [dict(default)] + ([dict(default, FAST_ACCUM=False)] if kind == "fp8-row" else [])
    configs += [cfg for cfg in candidates(kind, tokens * TOP_K / EXPERTS) if cfg != default]
    timed = []
    for cfg in configs:
        try:
            err = (run(cfg).float() - want).abs().max().item()
        except Exception as exc:  # a tile past shared memory, or not compilable
            print(f"{tokens:>6} | {cfg} | skipped: {type(exc).__name__}", flush=True)
            continue
        if err > tol:
            print(f"{tokens:>6} | {cfg} | skipped: max |diff| {err:.3g} from the default tiles", flush=True)
            continue
        timed.append((do_bench(capture(lambda c=cfg: run(c)).replay, rep=rep_ms, return_mode="median"), cfg))
    base = timed[0][0]
    defaults = [t for t in timed if t[1] in configs[:2]]
    best = sorted(timed, key=lambda t: t[0])[:6]
    for ms, cfg in best + [t for t in defaults if t not in best]:
        label = {0: "(default)", 1: "(default, K steps summed apart)"}.get(configs.index(cfg), "")
        print(
            f"{tokens:>6} | {rates(tokens, ids, experts, ms)} | {base / ms:5.2f}x | {cfg} {label}", flush=True
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512, 4096])
    parser.add_argument("--experts", choices=["bf16", "fp8-row", "fp8-block"], default="bf16")
    parser.add_argument("--sweep", action="store_true", help="time every candidate tile per token count")
    parser.add_argument("--loop", action="store_true", help="also time the per-expert torch reference")
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--vllm", action="store_true", help="also time vLLM's Triton experts")
    parser.add_argument("--config", type=json.loads, default=None, help="tiles over the defaults, as JSON")
    parser.add_argument("--align", action="store_true", help="time the grouping by expert alone, both forms")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.align:
        for tokens in args.tokens:
            bench_align(tokens, args.rep_ms, args.experts)
        return
    w13, w2 = bf16_experts()
    experts = make_experts(args.experts, w13, w2)
    vllm = vllm_experts(args.experts, w13, w2) if args.vllm else None
    print(f"{args.experts} experts, {EXPERTS} x ({HIDDEN} -> {INTER}), top-{TOP_K}", flush=True)
    for tokens in args.tokens:
        if args.sweep:
            sweep(tokens, args.rep_ms, args.experts, experts)
        else:
            bench(tokens, args.rep_ms, experts, args.loop, vllm, args.config)


if __name__ == "__main__":
    main()
