"""What the decode attention kernel compiles to on sm_90, without a GPU: counts of its memory and
matrix instructions per cache dtype, read from the PTX Triton emits.

Run from the project root: ``PYTHONPATH=. python3 benchmarks/kernel_ptx.py``. Integer arguments
are marked divisible by 16 as Triton's launcher marks the engine's (so loads vectorise as they do
there); counts are static instructions of the whole kernel, one tile-loop body included once.
"""

import argparse
import collections
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanovllm.kernels.decode_attention import _decode_split_kernel as kernel

_WATCHED = (
    "ld.global", "cp.async", "ld.shared", "st.shared", "ldmatrix", "stmatrix", "cvt.rn.f16x2.e4m3x2", "mma",
)  # fmt: skip
_UNSPECIALISED = {"num_splits", "stride_bt"}  # the kernel's do_not_specialize


def compile_ptx(cache_dtype: str, block_n: int, final: bool, f16_dot: bool, num_warps: int, num_stages: int):
    """The kernel for a Qwen3-8B-shaped GQA group (4 query heads per KV head, head_dim 128,
    128-token cache blocks) and a bf16 query, compiled for sm_90."""
    names = kernel.arg_names
    constexprs = dict(
        GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=128, BLOCK_N=block_n, SPLIT_ALIGN=16,
        FINAL=final, HAS_ORDER=False, DOT_PRECISION="tf32", F16_DOT=f16_dot,
    )  # fmt: skip
    partial_dtype = "bf16" if final else "fp32"
    pointers = {"q_ptr": "bf16", "k_cache_ptr": cache_dtype, "v_cache_ptr": cache_dtype,
                "block_tables_ptr": "i32", "context_lens_ptr": "i32", "order_ptr": "i32",
                "out_ptr": partial_dtype, "lse_ptr": partial_dtype}  # fmt: skip
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n in names
        if n not in constexprs and n not in _UNSPECIALISED and n != "qk_scale"
    }
    source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constexprs.items()}, attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["ptx"], compiled.metadata.shared


def instruction_counts(ptx: str) -> collections.Counter:
    ops = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)", ptx, re.M)
    return collections.Counter(op for op in ops if op.startswith(_WATCHED))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stages", type=int, default=2)
    args = parser.parse_args()
    # the engine's launches: one split (bf16: 64-token tiles; float8: 128 and an fp16 dot), and
    # the split kernel's 32-token tiles
    cases = [
        ("bf16 cache, one split", "bf16", 64, True, False, 4),
        ("fp8 cache, one split", "fp8e4nv", 128, True, True, 4),
        ("bf16 cache, splits", "bf16", 32, False, False, 4),
        ("fp8 cache, splits", "fp8e4nv", 32, False, False, 4),
    ]
    for label, dtype, block_n, final, f16_dot, warps in cases:
        ptx, shared = compile_ptx(dtype, block_n, final, f16_dot, warps, args.stages)
        counts = instruction_counts(ptx)
        print(f"{label}: {block_n}-token tiles, {warps} warps, {shared} B shared memory")
        for op, n in sorted(counts.items(), key=lambda item: -item[1]):
            print(f"  {n:5d} {op}")


if __name__ == "__main__":
    main()
