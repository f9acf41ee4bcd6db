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

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanovllm.kernels import decode_attention, prefill_attention
from nanovllm.kernels.kv_layout import KVLayout

_WATCHED = (
    "ld.global", "cp.async", "ld.shared", "st.shared", "ldmatrix", "stmatrix", "cvt.rn.f16x2.e4m3x2",
    "mma", "wgmma",
)  # fmt: skip


def compile_ptx(kernel, pointers: dict[str, str], constexprs: dict, num_warps: int, num_stages: int):
    """PTX and shared-memory bytes of ``kernel`` for sm_90; ``pointers`` maps pointer arguments
    to element types, other arguments are 32-bit (``qk_scale`` fp32)."""
    names, unspecialised = kernel.arg_names, set(kernel.do_not_specialize)

    def arg_type(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name in pointers:
            return "*" + pointers[name]
        return "fp32" if name in ("qk_scale", "eps") else "i32"

    # pointers and integers that Triton's launcher would mark divisible by 16
    divisible = [n for n in names if arg_type(n) == "i32" or n in pointers]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible if n not in unspecialised}
    constants = {(names.index(k),): v for k, v in constexprs.items()}
    source = ASTSource(kernel, {n: arg_type(n) for n in names}, constants, attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.asm["ptx"], compiled.metadata.shared


_BLOCK_SIZE = 128
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp8e4nv": torch.float8_e4m3fn}


def decode_ptx(cache_dtype: str, num_splits: int, prologue: bool = False):
    """The decode kernel as ``paged_decode_attention`` launches it with ``num_splits`` splits
    (``cache_dtype``: bf16, fp8e4nv) over the engine's cache layout, with the q/k prologue
    inside (Qwen3's norms) or not."""
    torch_dtype = _TORCH_DTYPES[cache_dtype]
    layout = KVLayout.for_dtype(torch_dtype)
    launch = decode_attention.launch_settings(
        num_splits, 128, torch_dtype.itemsize, torch.bfloat16, layout, _BLOCK_SIZE
    )
    partial_dtype = "bf16" if num_splits == 1 else "fp32"
    pointers = dict(
        q_ptr="bf16", k_cache_ptr=cache_dtype, v_cache_ptr=cache_dtype, block_tables_ptr="i32",
        context_lens_ptr="i32", order_ptr="i32", out_ptr=partial_dtype, lse_ptr=partial_dtype,
        new_k_ptr="bf16", new_v_ptr="bf16", positions_ptr="i64", cos_sin_ptr="fp32", q_weight_ptr="bf16",
        k_weight_ptr="bf16", slot_mapping_ptr="i32",
    )  # fmt: skip
    constexprs = dict(
        GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=_BLOCK_SIZE, BLOCK_N=launch.block_n,
        SPLIT_ALIGN=launch.split_align, FINAL=num_splits == 1, HAS_ORDER=False,
        V_TOKEN_MAJOR=layout.v_token_major, DOT_PRECISION="tf32", F16_DOT=launch.f16_dot,
        PROLOGUE=prologue, HAS_NORM=prologue, NUM_KV_HEADS=8, V_LARGEST=torch.finfo(torch_dtype).max,
    )  # fmt: skip
    kernel = decode_attention._decode_split_kernel
    return compile_ptx(kernel, pointers, constexprs, launch.num_warps, launch.num_stages)


def prefill_ptx(cache_dtype: str):
    """The prefill kernel as ``paged_prefill_attention`` launches it for a bf16 query over the
    engine's cache layout."""
    torch_dtype = _TORCH_DTYPES[cache_dtype]
    layout = KVLayout.for_dtype(torch_dtype)
    launch = prefill_attention.launch_settings(128, torch_dtype.itemsize, torch.bfloat16, layout, _BLOCK_SIZE)
    pointers = dict(
        q_ptr="bf16", k_cache_ptr=cache_dtype, v_cache_ptr=cache_dtype, out_ptr="bf16",
        cu_seqlens_q_ptr="i32", context_lens_ptr="i32", block_tables_ptr="i32",
    )  # fmt: skip
    constexprs = dict(
        GROUP=4, HEAD_DIM=128, BLOCK_SIZE=_BLOCK_SIZE, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        V_TOKEN_MAJOR=layout.v_token_major, DOT_PRECISION="tf32", F16_DOT=launch.f16_dot,
    )  # fmt: skip
    kernel = prefill_attention._prefill_kernel
    return compile_ptx(kernel, pointers, constexprs, launch.num_warps, launch.num_stages)


def instruction_counts(ptx: str) -> collections.Counter:
    ops = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)", ptx, re.M)
    return collections.Counter(op for op in ops if op.startswith(_WATCHED))


def main() -> None:
    for dtype in ("bf16", "fp8e4nv"):
        for label, (ptx, shared) in (
            (f"decode attention, {dtype} cache, one split", decode_ptx(dtype, 1)),
            (f"decode attention, {dtype} cache, splits", decode_ptx(dtype, 8)),
            (f"decode attention, {dtype} cache, splits, q/k prologue", decode_ptx(dtype, 8, prologue=True)),
            (f"prefill attention, {dtype} cache", prefill_ptx(dtype)),
        ):
            print(f"{label}: {shared} B shared memory")
            for op, n in sorted(instruction_counts(ptx).items(), key=lambda item: -item[1]):
                print(f"  {n:5d} {op}")


if __name__ == "__main__":
    main()
