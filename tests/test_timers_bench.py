"""``gpuhedge-celery bench timers`` runs end to end (tiny sizes) and prints the promised JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpuhedge_celery", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=100,
    )


def test_bench_timers_json_shape_and_nothing_lost(redis_url, prefix):
    env = {"GPUHEDGE_REDIS_URL": redis_url, "GPUHEDGE_PREFIX": prefix}
    args = ("bench", "timers", "--json", "--timers", "60", "--window", "0.5", "--lease-ms", "300")
    proc = run_cli(*args, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["bench"] == "timers"
    plain, killed = out["results"]
    assert (plain["killed"], killed["killed"]) == (0, 1)
    for row in out["results"]:
        assert row["timers"] == 60 and row["fired"] == 60 and row["lost"] == 0
        for field in ("lag_p50_ms", "lag_p99_ms", "lag_max_ms", "duplicates", "processes"):
            assert field in row
        assert 0 <= row["lag_p50_ms"] <= row["lag_p99_ms"] <= row["lag_max_ms"]
    assert killed["processes"] >= 2
    assert out["setup"]["threads"] == 1 and {row["threads"] for row in out["results"]} == {1}


def test_bench_timers_threads_option_reaches_the_services(redis_url, prefix):
    env = {"GPUHEDGE_REDIS_URL": redis_url, "GPUHEDGE_PREFIX": prefix}
    args = ("bench", "timers", "--json", "--timers", "60", "--window", "0.5", "--lease-ms", "300")
    proc = run_cli(*args, "--threads", "4", env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["setup"]["threads"] == 4
    for row in out["results"]:
        assert row["threads"] == 4
        assert row["fired"] == 60 and row["lost"] == 0  # the killed row too: pooled claims
        assert 0 <= row["lag_p50_ms"] <= row["lag_p99_ms"] <= row["lag_max_ms"]
    assert out["results"][1]["killed"] == 1


def test_bench_timers_spread_over_shards_fire_every_timer_once(redis_url, prefix):
    env = {"GPUHEDGE_REDIS_URL": redis_url, "GPUHEDGE_PREFIX": prefix}
    args = ("bench", "timers", "--json", "--timers", "60", "--window", "0.5", "--lease-ms", "300")
    proc = run_cli(*args, "--shards", "3", "--threads", "4", env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["setup"]["shards"] == 3
    for row in out["results"]:
        assert row["shards"] == 3
        assert row["fired"] == 60 and row["lost"] == 0  # the killed row too
    assert out["results"][1]["killed"] == 1


def test_bench_timers_rejects_zero_threads(redis_url):
    proc = run_cli("bench", "timers", "--threads", "0", env={"GPUHEDGE_REDIS_URL": redis_url})
    assert proc.returncode == 2 and "--threads" in proc.stderr


def test_bench_timers_without_redis_exits_3(private_redis):
    url = private_redis.url
    private_redis.stop()
    proc = run_cli("bench", "timers", "--timers", "3", env={"GPUHEDGE_REDIS_URL": url})
    assert proc.returncode == 3
    assert len(proc.stderr.strip().splitlines()) == 1 and "unreachable" in proc.stderr
