"""The architecture holds: the layers import one way, nothing imports in a cycle, the resource
and orchestration layers run without torch, and a file that grows long is flagged.

Imports are read from the source (type-only and function-level imports included).
"""

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nanovllm"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(module: str) -> set[str]:
    """Every module ``module`` imports: ours by full name, others by top-level package."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name if name.startswith("nanovllm") else name.split(".")[0] for name in found}


GRAPH = {module: imports_of(module) for module in MODULES}


def ours(module: str) -> set[str]:
    return {m for m in GRAPH[module] if m.startswith("nanovllm")}


def in_layer(module: str, *layers: str) -> bool:
    return any(module == f"nanovllm.{layer}" or module.startswith(f"nanovllm.{layer}.") for layer in layers)


def test_the_import_graph_is_read():
    assert "nanovllm.scheduling.block_manager" in ours("nanovllm.scheduling.scheduler")
    assert "xxhash" in GRAPH["nanovllm.scheduling.block_manager"]
    assert "torch" in GRAPH["nanovllm.execution.model_runner"]


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(ours(module)):
            if dep not in MODULES:
                continue
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])


def test_resource_layer_imports_only_python_and_itself():
    allowed_third_party = {"xxhash"}
    for module in MODULES:
        if not in_layer(module, "scheduling"):
            continue
        for dep in GRAPH[module]:
            if dep.startswith("nanovllm"):
                assert in_layer(dep, "scheduling") or dep == "nanovllm.sampling_params", (module, dep)
            else:
                assert dep in sys.stdlib_module_names or dep in allowed_third_party, (module, dep)


@pytest.mark.parametrize("package", ["nanovllm.scheduling", "nanovllm.engine.llm_engine", "nanovllm.config"])
def test_resource_and_orchestration_layers_load_without_torch(package):
    code = f"import sys, {package}; sys.exit(int('torch' in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True)
    assert result.returncode == 0, f"importing {package} loaded torch" + result.stderr


def torch_importers_reachable(module: str, seen: set[str]) -> list[str]:
    """Modules of ours reachable from ``module`` whose own imports include torch."""
    if module in seen or module not in MODULES:
        return []
    seen.add(module)
    found = [module] if "torch" in GRAPH[module] else []
    for dep in ours(module):
        found += torch_importers_reachable(dep, seen)
    return found


def test_engine_and_config_reach_no_torch_even_in_function_level_imports():
    for module in MODULES:
        if in_layer(module, "engine") or module == "nanovllm.config":
            assert not torch_importers_reachable(module, set()), module


def test_orchestration_reaches_execution_only_through_the_executor_interface():
    for module in MODULES:
        if not in_layer(module, "engine"):
            continue
        assert "torch" not in GRAPH[module], module
        for dep in ours(module):
            assert in_layer(dep, "engine", "scheduling") or dep in (
                "nanovllm.config",
                "nanovllm.sampling_params",
                "nanovllm.outputs",
                "nanovllm.beam_search",
            ), (
                module,
                dep,
            )


def test_resources_and_model_code_know_nothing_above_them():
    for module in MODULES:
        if in_layer(module, "scheduling"):
            forbidden = ("engine", "execution", "models", "layers", "attention", "kernels", "llm")
        elif in_layer(module, "models", "layers", "attention", "kernels"):
            forbidden = ("engine", "scheduling", "execution", "llm")
        elif in_layer(module, "execution"):
            forbidden = ("engine", "llm")
        else:
            continue
        for dep in ours(module):
            assert not in_layer(dep, *forbidden), (module, dep)


def test_kernels_stand_alone():
    for module in MODULES:
        if in_layer(module, "kernels"):
            assert all(in_layer(dep, "kernels") for dep in ours(module)), module


LONG_FILE_LINES, MAX_FILE_LINES = 400, 600


@pytest.mark.parametrize("module", sorted(MODULES))
def test_long_files_are_flagged(module):
    """A file is one idea, split by idea rather than by length: past ~400 lines it is worth a
    look (a warning); past 600 it is surely several."""
    path = MODULES[module]
    lines = path.read_text().count("\n")
    assert lines <= MAX_FILE_LINES, f"{path} has {lines} lines: split it by idea"
    if lines > LONG_FILE_LINES:
        warnings.warn(f"{path} has {lines} lines: is it still one idea?", stacklevel=1)
