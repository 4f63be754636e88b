"""The import graph of the ``gpuhedge_celery`` package, read from its source, and its cycles.

Every import of a package module counts: at module level, inside functions (deferred) and under
``if TYPE_CHECKING:``. A deferred or type-only import that closes a cycle works today, but it
hides which module builds on which, and one refactoring that moves it to the top turns it into
``ImportError: ... partially initialized module``. Imports by string (``importlib``) are not
seen here; the fresh-interpreter tests cover those.

Run ``python -m tests.support.import_graph`` to print the cycles (exit 1 when there are any).
"""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gpuhedge_celery"


_PARSE_IN_CHILD = (
    "import ast, pickle, sys; "
    "sys.stdout.buffer.write(pickle.dumps(ast.parse(open(sys.argv[1], encoding='utf-8').read())))"
)


def parse_file(path: Path) -> ast.Module:
    """``ast.parse`` of a file. CPython 3.11 before 3.11.8 can refuse it with "AST constructor
    recursion depth mismatch" when another thread of the process parses at the same time (the
    converter's depth is shared state); the file is then parsed in a fresh interpreter."""
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except SystemError:
        done = subprocess.run(
            [sys.executable, "-c", _PARSE_IN_CHILD, str(path)], capture_output=True, check=True
        )
        return pickle.loads(done.stdout)


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (``__main__`` included)."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _targets(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join([*base, *([node.module] if node.module else [])])
    else:
        target = node.module or ""
    # `from pkg import sub` imports the submodule pkg.sub when there is one
    return [f"{target}.{alias.name}" for alias in node.names] + [target]


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source."""
    modules = package_modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(parse_file(path)):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                candidates = _targets(name, path.name == "__init__.py", node)
                submodules = [c for c in candidates[:-1] if c in modules]
                found.update(submodules or candidates[-1:])
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def describe(graph: dict[str, set[str]], component: list[str]) -> str:
    inside = set(component)
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & inside))}" for m in component)


def main() -> int:
    graph = import_graph()
    found = cycles(graph)
    for component in found:
        print(describe(graph, component))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
