"""The weight prefetch as it compiles for sm_90 (no GPU needed, ``ptxas`` assembling the PTX):
the small-batch GEMM asks L2 for its first weight lines before it waits for the kernel ahead,
and a kernel before it lets it launch once its own wait is over."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")

ROOT = Path(__file__).parents[2]

# compiled in a process of its own: under TRITON_INTERPRET=1 (the tests') kernels are interpreted
_COMPILE = """
import json, re
from benchmarks.kernel_ptx import compile_ptx
from nanovllm.kernels import decode_reduce, small_batch_gemm

def order(ptx):
    ops = re.findall(r"prefetch\\.global\\.L2|griddepcontrol\\.wait|griddepcontrol\\.launch_dependents", ptx)
    return [op for i, op in enumerate(ops) if i == 0 or op != ops[i - 1]]

bf16 = dict.fromkeys(("x_ptr", "w_ptr", "bias_ptr", "out_ptr"), "bf16")
gemm = dict(HAS_BIAS=False, EVEN_K=True, PRECISION="tf32", BLOCK_M=16, BLOCK_K=512, PDL=True)
out = {}
for lines in (0, 16):
    for swiglu, block_n in ((False, 16), (True, 32)):
        ptx, _ = compile_ptx(
            small_batch_gemm._small_batch_gemm_kernel, bf16,
            dict(gemm, SWIGLU=swiglu, BLOCK_N=block_n, PREFETCH_LINES=lines), 2, 3,
        )
        out[f"gemm swiglu={swiglu} lines={lines}"] = order(ptx)
for release in (False, True):
    ptx, _ = compile_ptx(
        decode_reduce._decode_reduce_kernel, dict(part_ptr="fp32", lse_ptr="fp32", out_ptr="bf16"),
        dict(BLOCK_S=8, CHUNK=8, HEAD_DIM=128, BLOCK_D=32, PDL=True, RELEASE=release), 4, 1,
    )
    out[f"reduce release={release}"] = order(ptx)
print(json.dumps(out))
"""


def test_prefetch_before_the_wait_and_release_after_it():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600, check=True
    )
    order = json.loads(run.stdout.splitlines()[-1])
    for swiglu in (False, True):
        assert order[f"gemm swiglu={swiglu} lines=0"] == ["griddepcontrol.wait"]
        assert order[f"gemm swiglu={swiglu} lines=16"] == ["prefetch.global.L2", "griddepcontrol.wait"]
    assert order["reduce release=False"] == ["griddepcontrol.wait"]
    assert order["reduce release=True"] == ["griddepcontrol.wait", "griddepcontrol.launch_dependents"]
