"""What has been compiled so far in this process: each Triton kernel's specialization variants and
torch.compile's graphs. A warm engine compiles nothing more: a first run of new prompts that
compiles pays for it in its steps (``benchmarks/first_run.py``, ``tests/end_to_end``)."""

import importlib
import pkgutil

import nanovllm.kernels


def triton_kernels() -> dict[str, object]:
    """Every compiled-mode ``@triton.jit`` function of ``nanovllm.kernels``, by
    ``module.name`` (none under the interpreter, which compiles nothing)."""
    from triton.runtime.jit import JITFunction

    found = {}
    for info in pkgutil.iter_modules(nanovllm.kernels.__path__):
        module = importlib.import_module(f"nanovllm.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, JITFunction):
                found[f"{info.name}.{name}"] = value
    return found


def compiled_variants(kernels: dict[str, object]) -> dict[str, set[str]]:
    """The specialization keys each of ``kernels`` has compiled, on every device."""
    variants = {}
    for name, kernel in kernels.items():
        keys = set()
        for entry in getattr(kernel, "device_caches", {}).values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            keys.update(str(key) for key in cache)
        variants[name] = keys
    return variants


def dynamo_graphs() -> int:
    """Graphs torch.compile has compiled so far in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"].get("unique_graphs", 0)
