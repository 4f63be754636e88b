"""The pure core must not import Celery, Redis or httpx (the architecture, enforced)."""

from __future__ import annotations

import ast
import pathlib

import pytest

CORE = pathlib.Path(__file__).parent.parent / "gpuhedge_celery" / "core"
FORBIDDEN = ("celery", "kombu", "redis", "fakeredis", "httpx")


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: p.name)
def test_core_module_imports_no_io_library(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_core_has_modules():
    assert len(list(CORE.glob("*.py"))) >= 3
