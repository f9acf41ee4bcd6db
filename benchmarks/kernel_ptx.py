"""What the attention kernels compile to on sm_90, without a GPU: counts of their memory and
matrix instructions per cache dtype, read from the PTX Triton emits.

Run from the project root: ``PYTHONPATH=. python3 benchmarks/kernel_ptx.py``. Shapes are
Qwen3-8B's (4 query heads per KV head, head_dim 128) with 128-token cache blocks and a bf16
query; launch settings are the engine's. Integer arguments are marked divisible by 16 as Triton's
launcher marks the engine's, so loads vectorise as they do there. Counts are static
instructions: a tile loop's body counts once.
"""

import collections
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanovllm.kernels import decode_attention, prefill_attention

_WATCHED = (
    "ld.global", "cp.async", "ld.shared", "st.shared", "ldmatrix", "stmatrix", "cvt.rn.f16x2.e4m3x2",
    "mma", "wgmma",
)  # fmt: skip


def compile_ptx(kernel, pointers: dict[str, str], constexprs: dict, num_warps: int, num_stages: int):
    """PTX and shared-memory bytes of ``kernel`` for sm_90; ``pointers`` maps pointer arguments
    to element types, other arguments are 32-bit (``qk_scale`` fp32)."""
    names, unspecialised = kernel.arg_names, set(kernel.do_not_specialize)
    signature = {
        n: "constexpr"
        if n in constexprs
        else "*" + pointers[n]
        if n in pointers
        else "fp32"
        if n == "qk_scale"
        else "i32"
        for n in names
    }
    divisible = [n for n in names if n not in constexprs and n not in unspecialised and n != "qk_scale"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constexprs.items()}, attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["ptx"], compiled.metadata.shared


def decode_ptx(cache_dtype: str, one_split: bool):
    """The decode kernel as ``paged_decode_attention`` launches it (``cache_dtype``: bf16, fp8e4nv)."""
    float8 = cache_dtype == "fp8e4nv"
    block_n = (128 if float8 else 64) if one_split else decode_attention._SPLIT_BLOCK_N
    stages = decode_attention._FINAL_STAGES if one_split else decode_attention._SPLIT_STAGES
    partial_dtype = "bf16" if one_split else "fp32"
    pointers = dict(
        q_ptr="bf16", k_cache_ptr=cache_dtype, v_cache_ptr=cache_dtype, block_tables_ptr="i32",
        context_lens_ptr="i32", order_ptr="i32", out_ptr=partial_dtype, lse_ptr=partial_dtype,
    )  # fmt: skip
    constexprs = dict(
        GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=128, BLOCK_N=block_n, SPLIT_ALIGN=16, FINAL=one_split,
        HAS_ORDER=False, DOT_PRECISION="tf32", F16_DOT=one_split and float8,
    )  # fmt: skip
    return compile_ptx(decode_attention._decode_split_kernel, pointers, constexprs, 4, stages)


def prefill_ptx(cache_dtype: str):
    """The prefill kernel as ``paged_prefill_attention`` launches it for a bf16 query."""
    block_m, block_n, stages = prefill_attention._tiles(128, 2)
    pointers = dict(
        q_ptr="bf16", k_cache_ptr=cache_dtype, v_cache_ptr=cache_dtype, out_ptr="bf16",
        cu_seqlens_q_ptr="i32", context_lens_ptr="i32", block_tables_ptr="i32",
    )  # fmt: skip
    constexprs = dict(
        GROUP=4, HEAD_DIM=128, BLOCK_SIZE=128, BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION="tf32"
    )
    return compile_ptx(
        prefill_attention._prefill_kernel, pointers, constexprs, prefill_attention._NUM_WARPS, stages
    )


def instruction_counts(ptx: str) -> collections.Counter:
    ops = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)", ptx, re.M)
    return collections.Counter(op for op in ops if op.startswith(_WATCHED))


def main() -> None:
    cases = {
        f"{kind} attention, {dtype} cache{suffix}": build
        for dtype in ("bf16", "fp8e4nv")
        for kind, suffix, build in (
            ("decode", ", one split", lambda d=dtype: decode_ptx(d, True)),
            ("decode", ", splits", lambda d=dtype: decode_ptx(d, False)),
            ("prefill", "", lambda d=dtype: prefill_ptx(d)),
        )
    }
    for label, build in cases.items():
        ptx, shared = build()
        print(f"{label}: {shared} B shared memory")
        for op, n in sorted(instruction_counts(ptx).items(), key=lambda item: -item[1]):
            print(f"  {n:5d} {op}")


if __name__ == "__main__":
    main()
