"""Triton kernels on CPU through the interpreter. Import this before anything imports triton.

``TRITON_INTERPRET`` is read when ``@triton.jit`` runs, for triton's own library too, so it
only works if set before triton is first imported. If something imported triton first
(``STALE_TRITON``), a kernel test module runs itself again in a fresh subprocess instead.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STALE_TRITON = DEVICE == "cpu" and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

FRESH_RUN_TEST = "test_kernels_in_fresh_interpreter"


def skip_if_stale(request: pytest.FixtureRequest) -> None:
    if STALE_TRITON and request.node.originalname != FRESH_RUN_TEST:
        pytest.skip("triton was imported before interpreter mode: checked in a subprocess")


def run_in_fresh_interpreter(test_file: str) -> None:
    """Run ``test_file`` in a new process with the interpreter on; fail if it fails."""
    if not STALE_TRITON:
        pytest.skip("the kernels run in this process")
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
