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
    # one record per race; a race may append a corrected one after it (its receipt rewritten,
    # its finish time kept), but is never finished twice
    on, off = runs["on"], runs["off"]
    assert on["races_recorded"] == 10 and on["races_finished_twice"] == 0
    assert on["records_written"] == 10 + on["records_rewritten"]
    assert off["records_written"] == off["races_recorded"] == 0
    assert runs["on"]["finished"] == runs["off"]["finished"] == 10
    assert row["delta_ms"] == pytest.approx(
        runs["on"]["cpu_ms_per_race"] - runs["off"]["cpu_ms_per_race"], abs=0.011
    )


def test_a_rewritten_record_is_told_apart_from_a_second_finish():
    from gpuhedge_celery.bench._records_pair import _tally

    entries = [("a", 1.0), ("b", 2.0), ("a", 1.0), ("c", 3.0), ("b", 2.5)]
    assert _tally(entries) == {
        "records_written": 5,
        "races_recorded": 3,
        "records_rewritten": 1,  # a: its receipt rewritten, its finish time kept
        "races_finished_twice": 1,  # b: a second finish, at another time
    }
