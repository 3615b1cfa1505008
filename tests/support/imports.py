"""gpumon's import graph read from the source (imports inside functions count; ``if TYPE_CHECKING:``
blocks do not): the structure and layer tests judge it."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = Path(REPO) / "gpumon"


def modules() -> dict[str, Path]:
    """Every module under gpumon/ by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _source_of(node: ast.ImportFrom, name: str, is_package: bool) -> str | None:
    if not node.level:
        return node.module
    base = name if is_package else name.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The gpumon modules ``name`` imports anywhere in its body, TYPE_CHECKING blocks excepted."""
    out: set[str] = set()
    is_package = path.name == "__init__.py"
    stack: list[ast.AST] = [ast.parse(path.read_text(encoding="utf-8"), str(path))]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            source = _source_of(node, name, is_package)
            for alias in node.names if source else ():
                target = f"{source}.{alias.name}"
                out.add(target if target in known else source)
        stack.extend(child for child in ast.iter_child_nodes(node)
                     if not (isinstance(child, ast.stmt) and _is_type_checking(child)))
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}
