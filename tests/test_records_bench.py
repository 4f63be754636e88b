"""``bench races --rows records`` with tiny counts: both sides run, only "on" writes records."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.timeout(180)


def test_bench_races_records_row_compares_records_on_and_off(redis_url):
    script = shutil.which("gpuhedge-celery")
    assert script, "gpuhedge-celery is not installed (pip install -e .)"
    argv = [script, "--redis-url", redis_url, "bench", "races", "--json", "--rows", "records",
            "--races", "10", "--duration-s", "1", "--workers", "1",
            "--record-pairs", "1"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(done.stdout)["results"]
    assert row["row"] == "records" and row["pairs"] == 1
    runs = {r["records"]: r for r in row["runs"]}
    assert set(runs) == {"off", "on"}
    # one record per race; a race may append a corrected one after it (its receipt rewritten)
    assert runs["on"]["races_recorded"] == 10 and runs["on"]["records_written"] >= 10
    assert runs["off"]["records_written"] == runs["off"]["races_recorded"] == 0
    assert runs["on"]["finished"] == runs["off"]["finished"] == 10
    assert row["delta_ms"] == pytest.approx(
        runs["on"]["cpu_ms_per_race"] - runs["off"]["cpu_ms_per_race"], abs=0.011
    )
