"""What the attention kernels compile to on sm_90, read from the PTX Triton emits for any
target (no GPU needed): a float8 cache, in the engine's layout, must not be read a byte at a
time, from global or from shared memory."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")

ROOT = Path(__file__).parents[2]


def compiled_instruction_counts() -> dict[str, dict[str, int]]:
    """``benchmarks/kernel_ptx.py``'s counts per case. A process of its own: under
    TRITON_INTERPRET=1 (the tests') kernels are interpreted, not compiled."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernel_ptx.py")],
        env=env, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    cases: dict[str, dict[str, int]] = {}
    for line in run.stdout.splitlines():
        if not line.startswith(" "):
            counts = cases[line.split(":")[0]] = {}
        else:
            count, op = line.split()
            counts[op] = int(count)
    return cases


BYTE_LOADS = tuple(f"ld.{space}.{kind}8" for space in ("global", "shared") for kind in "bus")


def test_float8_cache_is_read_in_vectors():
    cases = compiled_instruction_counts()
    assert len(cases) == 8 and sum("fp8" in label for label in cases) == 4
    for label, counts in cases.items():
        assert any(op.startswith(("mma", "wgmma")) for op in counts), label
        assert any(op.startswith("cp.async") for op in counts), label  # K/V loads are pipelined
        assert not [op for op in counts if op.startswith(BYTE_LOADS)], (label, counts)
