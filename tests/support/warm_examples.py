"""Warm ``python:`` runners of each form, for tests/test_model_runners.py.

``Counter`` (``module:Class``) counts its loads and runs; ``Broken`` fails to load; ``NoRun``
has nothing to run. The module itself is the ``module`` form: ``load()`` / ``run()`` / ``close()``.
"""

from __future__ import annotations

import os

LOADED: list[str] = []  # what this process loaded, in order
CLOSED: list[str] = []


class Counter:
    def __init__(self) -> None:
        self.runs = 0

    def load(self) -> None:
        LOADED.append("Counter")

    def run(self, request, ctx):
        self.runs += 1
        return {"runs": self.runs, "gpu": ctx.gpu_id, "request": request, "pid": os.getpid()}

    def close(self) -> None:
        CLOSED.append("Counter")


class Broken:
    def load(self) -> None:
        raise RuntimeError("CUDA out of memory while loading weights")

    def run(self, request):
        return request


class NoRun:
    pass


_state: dict[str, int] = {}


def load() -> None:
    LOADED.append("module")
    _state["scale"] = 3


def run(request):
    return request * _state["scale"]


def close() -> None:
    CLOSED.append("module")
    _state.clear()
