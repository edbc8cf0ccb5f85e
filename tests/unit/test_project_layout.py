"""Rules about the project's own layout: test modules share code through non-test modules only, and the reference
package never imports pytest (it runs inside vLLM, where pytest is no dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_FOLDERS = ("conformance", "tests", "bench", "integration")


def _imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, relative imports resolved against its package (``conformance.x``)."""
    package = path.relative_to(ROOT).parent.parts
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def test_no_test_module_imports_another_test_module():
    found = []
    for folder in TEST_FOLDERS:
        for path in sorted((ROOT / folder).rglob("test_*.py")):
            for name in _imported_modules(path):
                if any(part.startswith("test_") for part in name.split(".")):
                    found.append(f"{path.relative_to(ROOT)} imports {name}")
    assert found == [], f"test modules import test modules (move the shared code into a non-test module): {found}"


def test_the_reference_package_never_imports_pytest():
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "reference").rglob("*.py"))
        for name in _imported_modules(path)
        if name == "pytest" or name.startswith(("pytest.", "_pytest"))
    ]
    assert found == [], f"reference/ must not import pytest: {found}"
