"""torch.compile for the small element-wise ops, where kernel fusion pays (CUDA)."""

import torch
from torch import nn


def compile_elementwise_ops(model: nn.Module) -> None:
    """Swap each module's ``compilable`` function attributes for compiled versions.

    One compiled wrapper per function, shared by every module that uses it, with dynamic
    shapes so token counts do not trigger recompiles.
    """
    compiled: dict = {}
    for module in model.modules():
        for name in getattr(module, "compilable", ()):
            fn = getattr(module, name)
            if fn not in compiled:
                compiled[fn] = torch.compile(fn, dynamic=True)
            setattr(module, name, compiled[fn])
