"""Does programmatic dependent launch (PDL) shorten a chain of small kernels in a CUDA graph?

    PYTHONPATH=. python3 benchmarks/bench_pdl.py [--mib 8,32] [--layers 28]

Small-batch decode attention reads a few MB a layer and then combines its splits, so a
decode step at batch 1 is a chain of short kernels whose launch gaps and start-up cost as much
as their reads. This probe models that chain without attention's arithmetic: per layer a read
kernel (many programs, each summing its slice of the layer's own buffer) and a combine kernel
(one program adding the partial sums), ``--layers`` layers in one CUDA graph, as the engine
replays a decode step. Variants:

- ``plain``: ordinary launches;
- ``pdl``: both kernels launched with PDL, each waiting for its predecessor first thing, then
  letting its own successor launch (so a successor's programs are resident when it ends);
- ``pdl+prefetch``: as ``pdl``, but the read kernel loads its slice before it waits. Legal
  when the predecessor does not write what is read, as for the cached K/V of every token but
  the newest in decode attention.

Prints microseconds per layer and the read rate as a share of a device copy. The outputs of
every variant are checked against ``torch.sum`` first.
"""

import argparse
from functools import partial

import torch
import triton
import triton.language as tl
from bench_decode_attention import copy_bandwidth  # beside this file
from bench_gemm import graph_us

BLOCK = 2048  # elements a program loads per step


@triton.jit
def _read_kernel(
    src_ptr, part_ptr, per_program, BLOCK: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr
):
    program = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    base = src_ptr + program.to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.float32)
    if PREFETCH:  # the first step's load does not depend on the predecessor
        acc += tl.load(base + offs).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for start in range(BLOCK if PREFETCH else 0, per_program, BLOCK):
        acc += tl.load(base + start + offs).to(tl.float32)
    tl.store(part_ptr + program, tl.sum(acc, 0))


@triton.jit
def _combine_kernel(part_ptr, out_ptr, num_parts, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.arange(0, BLOCK_P)
    tl.store(out_ptr, tl.sum(tl.load(part_ptr + offs, mask=offs < num_parts, other=0.0), 0))


def layer(src: torch.Tensor, part: torch.Tensor, out: torch.Tensor, variant: str) -> None:
    pdl, prefetch = variant != "plain", variant == "pdl+prefetch"
    programs = part.numel()
    _read_kernel[(programs,)](
        src, part, src.numel() // programs, BLOCK=BLOCK, PDL=pdl, PREFETCH=prefetch, launch_pdl=pdl
    )
    _combine_kernel[(1,)](
        part, out, programs, BLOCK_P=triton.next_power_of_2(programs), PDL=pdl, launch_pdl=pdl
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", default="8,32", help="MiB read a layer (batch 1 x 2k tokens of 0.6B: 8)")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--programs", type=int, default=0, help="read programs (default 4 a SM)")
    parser.add_argument("--rep-ms", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("needs a CUDA device of compute capability 9.0 or later")
    programs = args.programs or 4 * torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbs = copy_bandwidth(2**31, args.rep_ms)
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s (read + write), {programs} programs")
    for mib in map(int, args.mib.split(",")):
        elements = mib * 2**20 // 2 // (programs * BLOCK) * programs * BLOCK
        bufs = [torch.randn(elements, dtype=torch.bfloat16, device="cuda") for _ in range(args.layers)]
        parts = [torch.empty(programs, dtype=torch.float32, device="cuda") for _ in range(args.layers)]
        outs = [torch.empty(1, dtype=torch.float32, device="cuda") for _ in range(args.layers)]
        cells = []
        for variant in ("plain", "pdl", "pdl+prefetch"):
            layer(bufs[0], parts[0], outs[0], variant)
            expected = bufs[0].float().sum()
            torch.testing.assert_close(outs[0][0], expected, rtol=1e-3, atol=1e-1)
            calls = [partial(layer, b, p, o, variant) for b, p, o in zip(bufs, parts, outs)]
            us = graph_us(calls, args.rep_ms)
            cells.append(f"{variant} {us:6.1f} us ({100 * elements * 2 / us / 1e3 / copy_gbs:3.0f}%)")
        print(f"{mib:4d} MiB a layer: " + " | ".join(cells), flush=True)
        del bufs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
