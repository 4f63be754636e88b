"""The race runtime's shape: composed of collaborators, short signatures, and a size it keeps.

A class built from several project bases hides where a method comes from; a call with more
than five arguments cannot be read at the call site. These hold the race path to both.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).parent.parent / "gpuhedge_celery"
RACE = sorted((PACKAGE / "race").glob("*.py"))
# from hedged_infer to the receipt: the race runtime, its store, its tasks and webhooks
RACE_PATH = [
    *RACE,
    *sorted((PACKAGE / "store").glob("race*.py")),
    PACKAGE / "store" / "round_trip.py",
    *sorted((PACKAGE / "tasks").glob("race*.py")),
    PACKAGE / "webhooks" / "apply.py",
]
RACE_HALF = [*RACE_PATH, *sorted((PACKAGE / "core").glob("race*.py"))]
MAX_PARAMETERS = 5
MAX_RACE_HALF_LINES = 9_100


@functools.cache
def _project_classes() -> frozenset[str]:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
    return frozenset(names)


def _base_name(base: ast.expr) -> str:
    return base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")


@pytest.mark.parametrize("path", RACE, ids=lambda p: p.name)
def test_no_race_class_is_assembled_from_project_bases(path):
    project = _project_classes()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            bases = [_base_name(b) for b in node.bases if _base_name(b) in project]
            assert len(bases) <= 1, f"{path.name}: {node.name} mixes in {bases}"


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [f"*{x.arg}" for x in (a.vararg, a.kwarg) if x is not None]
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


@pytest.mark.parametrize("path", RACE_PATH, ids=lambda p: p.name)
def test_race_path_signatures_take_at_most_five_parameters(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            params = _parameters(node)
            assert len(params) <= MAX_PARAMETERS, f"{path.name}:{node.lineno} {node.name}{params}"


def test_the_race_half_stays_under_its_size():
    lines = sum(len(p.read_text().splitlines()) for p in RACE_HALF)
    assert lines < MAX_RACE_HALF_LINES, f"the race half has {lines} lines"
