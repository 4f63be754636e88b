"""Hostile input, fuzzed with Hypothesis (``tests/fuzz/``: configs, policy names, requests, the
``http`` and ``runpod`` adapters' responses), in a pytest of its own.

Those cases provoke ``RecursionError`` on purpose and run servers on threads that format
tracebacks; on CPython 3.11 before 3.11.8 the AST converter's recursion depth is shared by all
threads, and a clash ends in "SystemError: AST constructor recursion depth mismatch" wherever
source is parsed next (pytest parses source to render a failure: the whole suite's run would
stop with an INTERNALERROR). So the fuzzing runs in a fresh interpreter, and this test fails
with its output when any fuzz case fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def test_hostile_input_fuzzing_passes_in_its_own_interpreter():
    modules = sorted(str(p) for p in (REPO / "tests" / "fuzz").glob("fuzz_*.py"))
    assert len(modules) >= 2, modules
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *modules],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ),
    )  # fmt: skip
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and " failed" not in done.stdout, tail
