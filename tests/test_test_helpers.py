"""Test modules import helpers only from helper modules, never from another ``test_*`` module
(which would run that module's imports on collection and hide helpers among tests)."""

import ast
from pathlib import Path

TESTS = Path(__file__).parent
ROOT = TESTS.parent


def imported_modules(path: Path) -> set[str]:
    """Dotted names of the modules ``path`` imports from, relative imports resolved."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            # ``from tests.end_to_end import test_x`` imports a module too
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_test_modules_import_no_other_test_module():
    offenders = set()
    for path in sorted(TESTS.rglob("test_*.py")):
        for name in imported_modules(path):
            parts = name.split(".")
            tests = [i for i, part in enumerate(parts) if i and part.startswith("test_")]
            if parts[0] == "tests" and tests:
                offenders.add(f"{path.relative_to(ROOT)} imports {'.'.join(parts[: tests[0] + 1])}")
    assert not offenders, "move shared helpers into a helper module:\n" + "\n".join(sorted(offenders))
