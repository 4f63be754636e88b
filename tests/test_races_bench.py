"""``gpuhedge-celery bench races --json`` with tiny counts: the JSON shape, not the numbers."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.timeout(180)


def test_bench_races_prints_every_row_as_json(redis_url):
    script = shutil.which("gpuhedge-celery")
    assert script, "gpuhedge-celery is not installed (pip install -e .)"
    argv = [script, "--redis-url", redis_url, "bench", "races", "--json",
            "--overhead-races", "5", "--races", "10", "--duration-s", "1",
            "--cancel-races", "3", "--workers", "1"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["bench"] == "races"
    rows = {r["row"]: r for r in out["results"]}
    assert set(rows) == {"overhead", "celery-roundtrip", "capacity", "cancel"}
    for name in ("overhead", "celery-roundtrip"):
        assert rows[name]["n"] == 5 and rows[name]["p50_ms"] <= rows[name]["p99_ms"]
    assert set(rows["overhead"]["coordinator_e2e"]) >= {"p50_ms", "p99_ms"}
    capacity = rows["capacity"]
    assert capacity["races"] == 10 and capacity["finished"] == 10
    assert 1 <= capacity["concurrent_peak"] <= 10
    assert set(capacity["timer_lag_ms"]) >= {"n", "p50_ms", "p99_ms"}
    assert isinstance(capacity["meets_target"], bool)
    for key in ("cpu_pct", "redis_bytes_per_race", "worker_rss_bytes_per_race", "wall_s"):
        assert isinstance(capacity[key], (int, float))
    assert rows["cancel"]["races"] == 3 and rows["cancel"]["n"] <= 3


def test_bench_races_rejects_an_unknown_row():
    script = shutil.which("gpuhedge-celery")
    for bad in (["--rows", "nope"], ["--races", "many"]):
        done = subprocess.run([script, "bench", "races", *bad], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 2 and bad[1] in done.stderr, done.stderr
