"""A worker plugin that sets this process's wall clock off by ``$GPUHEDGE_TEST_SKEW_S`` seconds
(``time.time`` and ``time.time_ns``; monotonic time is untouched, as NTP leaves it): a host
whose clock drifted, for tests/test_faults_skew.py. Imported through ``GPUHEDGE_PLUGINS``."""

from __future__ import annotations

import os
import time

SKEW_S = float(os.environ.get("GPUHEDGE_TEST_SKEW_S", "0") or 0)

if SKEW_S and not getattr(time, "_gpuhedge_skewed", False):
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + SKEW_S  # type: ignore[assignment]
    time.time_ns = lambda: _time_ns() + int(SKEW_S * 1e9)  # type: ignore[assignment]
    time._gpuhedge_skewed = True  # type: ignore[attr-defined]
