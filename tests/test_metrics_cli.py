"""``gpuhedge-celery metrics list|serve``: the list matches the definitions; serve's errors."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from gpuhedge_celery.metrics.definitions import ALL_METRICS

pytestmark = pytest.mark.timeout(60)


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuhedge_celery", *args], capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def test_list_names_every_metric_with_its_samples():
    out = cli("metrics", "list", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["name"] for r in rows] == [m.name for m in ALL_METRICS]
    by_name = {r["name"]: r for r in rows}
    assert by_name["gpuhedge_races_hedged"]["samples"] == ["gpuhedge_races_hedged_total"]
    assert by_name["gpuhedge_pool_gpus"]["source"] == "redis"
    assert by_name["gpuhedge_race_e2e_seconds"]["type"] == "histogram"


def test_serve_on_a_taken_port_is_a_one_line_error(redis_url):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = cli("--redis-url", redis_url, "metrics", "serve", "--addr", "127.0.0.1",
                  "--port", str(port))  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "--port" in out.stderr, out.stderr


def test_serve_rejects_a_timer_namespace_that_cannot_be_a_key(redis_url):
    out = cli("--redis-url", redis_url, "metrics", "serve", "--port", "0",
              "--timer-namespace", "bad name{}")  # fmt: skip
    assert out.returncode == 2
    assert "--timer-namespace" in out.stderr and out.stderr.count("\n") == 1, out.stderr
