"""``gpuhedge-celery bench races --rows metrics`` with tiny counts: the JSON shape, not the
numbers (those are in docs/benchmarks.md)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_bench_races_metrics_row_alternates_off_and_on(redis_url):
    script = shutil.which("gpuhedge-celery")
    assert script, "gpuhedge-celery is not installed (pip install -e .)"
    argv = [script, "--redis-url", redis_url, "bench", "races", "--json", "--rows", "metrics",
            "--metrics-races", "8", "--metrics-duration-s", "1", "--metrics-pairs", "1",
            "--workers", "1"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(done.stdout)["results"]
    assert row["row"] == "metrics" and row["pairs"] == 1
    assert [r["metrics"] for r in row["runs"]] == ["off", "on"]
    off, on = row["runs"]
    assert off["finished"] == on["finished"] == 8
    assert "scrapes" not in off
    assert on["scrapes"] >= 1 and on["scrape_failures"] == 0  # the workers' endpoints answered
    assert on["scrape_wall_ms"] > 0 and on["scrape_bytes"] > 0
    assert set(row["hook_us"]) == {"provider_call", "timer_fired", "race_event"}
    expected = round(100.0 * (on["cpu_ms_per_race"] / off["cpu_ms_per_race"] - 1.0), 1)
    assert row["extra_cpu_median_pct"] == expected
