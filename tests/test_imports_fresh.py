"""Every public name and every documented import works alone, in a fresh interpreter.

A user's first line is often one import (``from gpuhedge_celery import pooled_infer``), in a
process where nothing of the package is loaded yet. An import cycle among the package's modules
only shows in that case, in whichever order the first import happens to load them, so each
name is imported alone in its own interpreter here, and the package's import graph must have
no cycle at all (deferred and type-only imports included).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.support.fresh_imports import REPO, run_each, run_each_forked
from tests.support.import_graph import (
    cycles,
    describe,
    import_graph,
    package_modules,
    parse_file,
)

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(?:python|py|pycon)\s*\n(.*?)^```", re.S | re.M)


def _all(path: Path) -> list[str]:
    """The names a module lists in a literal ``__all__`` (starred entries left out)."""
    for node in parse_file(path).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return []


def _has_module_getattr(path: Path) -> bool:
    tree = parse_file(path)
    return any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)


def documented_imports() -> dict[str, list[str]]:
    """Python snippet (named ``file#n``) -> its imports from gpuhedge_celery, one per statement."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for n, match in enumerate(_FENCE.finditer(doc.read_text(encoding="utf-8")), 1):
            statements = []
            for line in _logical_lines(match.group(1)):
                if re.match(r"(from|import)\s+gpuhedge_celery\b", line):
                    statements.append(line)
            if statements:
                found[f"{doc.relative_to(REPO)}#{n}"] = statements
    return found


def _logical_lines(code: str) -> list[str]:
    """Lines of ``code`` with parenthesised continuations joined, stripped (snippets may hold
    ``...`` or other text that is not Python, so they are not parsed as a whole)."""
    lines, pending = [], ""
    for raw in code.splitlines():
        line = raw.split("#", 1)[0].strip()
        pending = f"{pending} {line}".strip() if pending else line
        if pending.count("(") > pending.count(")"):
            continue
        if pending:
            lines.append(pending.replace("( ", "(").replace(" )", ")"))
        pending = ""
    return lines


def one_name_each(statement: str) -> list[str]:
    """``from m import a, b`` -> ``from m import a`` and ``from m import b``."""
    node = ast.parse(statement).body[0]
    if isinstance(node, ast.ImportFrom):
        return [f"from {node.module} import {alias.name}" for alias in node.names]
    return [statement]


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert graph["gpuhedge_celery.tasks.pool"], "the graph must see the package's imports"
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(describe(graph, c) for c in found)


def test_the_cycle_finder_finds_deferred_and_type_only_cycles(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import X\n"
    )
    (package / "c.py").write_text("def f():\n    from pkg.a import b\n")
    (package / "d.py").write_text("from .a import b\n")
    graph = import_graph(package)
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_every_name_of_the_package_imports_alone_in_a_new_interpreter(tmp_path):
    import gpuhedge_celery

    names = [n for n in gpuhedge_celery.__all__ if n != "__version__"]
    assert {"pooled_infer", "hedged_infer", "app", "receipt"} <= set(names)
    failures = run_each([f"from gpuhedge_celery import {n}" for n in names], tmp_path)
    assert not failures, failures


def test_every_module_and_its_public_names_import_alone(tmp_path):
    statements = []
    for name, path in package_modules().items():
        if name.endswith("__main__"):
            continue  # runs the CLI
        public = _all(path)
        if _has_module_getattr(path):  # lazy names: each one loads its own modules
            statements.extend(f"from {name} import {n}" for n in public)
        else:
            names = "".join(f"; {name}.{n}" for n in public)
            statements.append(f"import {name}{names}")
    assert len(statements) > 50
    failures = run_each_forked(statements, tmp_path)
    assert not failures, failures


def test_the_fork_runner_sees_a_failing_import(tmp_path):
    failures = run_each_forked(
        ["import gpuhedge_celery.errors", "from gpuhedge_celery import no_such_name"], tmp_path
    )
    assert list(failures) == ["from gpuhedge_celery import no_such_name"]
    assert "no_such_name" in failures["from gpuhedge_celery import no_such_name"]


def test_every_documented_snippet_imports_alone_in_a_new_interpreter(tmp_path):
    snippets = documented_imports()
    assert "README.md#1" in snippets  # "Use it from a Celery app"
    assert any("import pooled_infer" in s for v in snippets.values() for s in v)
    statements = []
    for imports in snippets.values():
        statements.append("\n".join(imports))  # the snippet's imports, as written
        for statement in imports:
            statements.extend(one_name_each(statement))  # and each name on its own
    failures = run_each(statements, tmp_path)
    assert not failures, failures


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("from gpuhedge_celery import a, b\n", ["from gpuhedge_celery import a, b"]),
        ("from gpuhedge_celery.x import (\n    a,\n    b,\n)\nx = 1\n",
         ["from gpuhedge_celery.x import (a, b,)"]),
        ("import gpuhedge_celery  # the package\nprint(1)\n", ["import gpuhedge_celery"]),
    ],
)  # fmt: skip
def test_snippet_imports_are_read_with_their_continuations(code, expected):
    lines = [line for line in _logical_lines(code) if "gpuhedge_celery" in line]
    assert lines == expected
    for line in lines:
        assert one_name_each(line)[0].startswith(("from gpuhedge_celery", "import gpuhedge"))
