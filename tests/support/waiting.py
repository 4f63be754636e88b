"""Polling with a deadline, for tests that wait on other processes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.02) -> T:
    """Return the first truthy value of ``predicate()``; AssertionError naming ``what`` at the
    deadline (so a hung condition fails with a readable message, never hangs the suite)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)
