"""Parses in the test process take turns (tests/conftest.py), even with a finalizer that parses.

On CPython 3.11 before 3.11.8 a parse nested in another, from a garbage collection's finalizer,
fails the outer one with "AST constructor recursion depth mismatch"; a failed test rendering its
traceback parses, so that stopped a whole CI run.
"""

from __future__ import annotations

import ast
import gc
import pathlib

RACE = pathlib.Path(__file__).parent.parent / "gpuhedge_celery" / "core" / "race.py"


class _ParsesWhenCollected:
    def __init__(self):
        self.cycle = self  # only a collection frees it

    def __del__(self):
        ast.parse("left + right")


def test_a_finalizer_that_parses_during_a_long_parse_does_not_break_it():
    source = RACE.read_text()
    threshold = gc.get_threshold()
    gc.set_threshold(50)
    try:
        for _ in range(10):
            garbage = [_ParsesWhenCollected() for _ in range(200)]
            del garbage
            assert isinstance(ast.parse(source), ast.Module)
    finally:
        gc.set_threshold(*threshold)
        gc.collect()
