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
            "--cancel-races", "3", "--workers", "1",
            "--rows", "overhead,capacity,cancel,budget",
            "--budget-races", "10", "--budget-pairs", "1"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["bench"] == "races"
    rows = {r["row"]: r for r in out["results"]}
    assert set(rows) == {"overhead", "celery-roundtrip", "capacity", "cancel", "budget"}
    budget = rows["budget"]
    assert [r["budgets"] for r in budget["runs"]] == ["off", "on"]
    assert all(r["won"] == 10 and r["open_reservations_left"] == 0 for r in budget["runs"])
    # budgets on: each race reserved and settled both its attempts in the ledger; off: none.
    # (EVALSHA counts are not compared: the reservation rides in the submit claim's script and
    # the settlement in the save's, so their count moves with the races' paths, not budgets.)
    off_run, on_run = budget["runs"]
    assert off_run["ledger_entries_per_race"] == 0
    assert on_run["ledger_entries_per_race"] >= 2 * on_run["submits_per_race"] >= 2
    assert budget["cpu_ms_per_race_on"] > 0 and len(budget["cpu_delta_pct_per_pair"]) == 1
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


def test_bench_races_audio_s_sets_the_payload_each_race_stores(redis_url):
    # A longer WAV per sim job: the payload grows with it, and Redis receives it (once) per race.
    # The Celery floor beside it: as many plain tasks, each returning that same payload.
    script = shutil.which("gpuhedge-celery")
    argv = [script, "--redis-url", redis_url, "bench", "races", "--json", "--rows",
            "capacity,floor", "--races", "6", "--duration-s", "1", "--workers", "1",
            "--audio-s", "4"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    capacity, floor = json.loads(done.stdout)["results"]
    assert floor["row"] == "celery-floor" and floor["tasks"] == 6
    assert floor["payload_bytes"] == capacity["payload_bytes"]
    # each task's result reached Redis with its payload; the workers' own requests were counted
    assert floor["redis_bytes_per_task"] > floor["payload_bytes"]
    assert floor["round_trips_per_task"] > 0 and floor["cpu_ms_per_task_by"]["workers"] > 0
    beside = floor["beside_capacity"]
    assert beside["cpu_ms_beyond_floor"] == pytest.approx(
        capacity["cpu_ms_per_race"] - floor["cpu_ms_per_task"], abs=0.011
    )
    assert 0 < beside["floor_share_of_race_cpu"]
    assert capacity["won"] == 6
    # 4 s of 16-bit 16 kHz mono: 128,000 bytes of samples, a third more as base64
    assert 4 * 42_000 < capacity["payload_bytes"] < 4 * 43_000
    assert capacity["redis_bytes_per_race"] > capacity["payload_bytes"]
    # every race's start against its send: after it (same host's clock), within the run
    intake = capacity["intake_lag_ms"]
    assert intake["n"] == 6
    assert 1 <= capacity["started_peak"] <= 6  # (the sent-and-unfinished peak is sampled)
    assert 0 <= intake["p50_ms"] <= intake["p99_ms"] < capacity["wall_s"] * 1000


def test_bench_races_rejects_an_unknown_row():
    script = shutil.which("gpuhedge-celery")
    for bad in (["--rows", "nope"], ["--races", "many"]):
        done = subprocess.run([script, "bench", "races", *bad], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 2 and bad[1] in done.stderr, done.stderr


def test_bench_races_memory_row_measures_each_phase(redis_url):
    script = shutil.which("gpuhedge-celery")
    argv = [script, "--redis-url", redis_url, "bench", "races", "--json", "--rows", "memory",
            "--memory-races", "3", "--request-bytes", "5000", "--workers", "1"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(done.stdout)["results"]
    assert row["row"] == "memory" and row["races"] == 3
    assert 4000 < row["request_key_strlen_while_racing"] <= 5000
    phases = row["phases"]
    for phase in ("primary_running", "both_running"):
        assert phases[phase]["races"] == 3
        assert phases[phase]["by_key_bytes_per_race"]["request"] > 4000
    finished = phases["finished"]
    assert finished["races"] == 3 and "request" not in finished["by_key_bytes_per_race"]
    assert finished["by_key_bytes_per_race"]["receipt"] > 0


def test_started_peak_counts_races_started_and_not_finished_at_once():
    from gpuhedge_celery.bench.race_capacity import started_peak

    spans = [(0.0, 10.0), (1.0, 2.0), (2.0, 3.0), (2.5, 4.0), (11.0, 12.0)]
    receipts = [{"created_at": a, "finished_at": b} for a, b in spans]
    # (0, 10), (2, 3) and (2.5, 4) overlap; (1, 2) ends as (2, 3) starts: not at once
    assert started_peak(receipts) == 3
    # a race without a start or an end (no receipt fields) is left out
    assert started_peak([*receipts, {"created_at": None, "finished_at": 5.0}]) == 3
    assert started_peak([]) == 0


def test_a_capacity_row_meets_its_target_only_with_its_races_started_promptly():
    from gpuhedge_celery.bench.race_capacity import meets_capacity_target

    def row(timer_p99, intake_p99):
        return {"timer_lag_ms": {"p99_ms": timer_p99}, "intake_lag_ms": {"p99_ms": intake_p99}}

    assert meets_capacity_target(row(14.0, 13.0))
    assert not meets_capacity_target(row(60.0, 13.0))  # hedges late
    # timers on time, but the races waited in the broker: not that many in flight
    assert not meets_capacity_target(row(14.0, 43_000.0))
    assert meets_capacity_target(row(None, 13.0))  # no race hedged: no timer late
    assert not meets_capacity_target(row(None, None))  # and none finished: nothing measured
