"""Triton kernels on CPU run through the interpreter, which must be on before triton loads.

``tests/__init__.py`` imports this first, so every test module sees the interpreter on.
"""

import os
import sys

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    if "triton" in sys.modules:
        raise RuntimeError(
            "triton was imported before the tests could switch its interpreter on; "
            "run the CPU tests with TRITON_INTERPRET=1"
        )
    os.environ["TRITON_INTERPRET"] = "1"

# kernel tests' dtypes: the interpreter gets bf16 ``tl.dot`` wrong, so bf16 runs on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
