"""The pool benchmark's arithmetic (pure) and one tiny run of the command on the real Redis."""

from __future__ import annotations

import json
import statistics
import time

import pytest
from click.testing import CliRunner

from gpuhedge_celery.bench.pool import (
    Record,
    Workload,
    ideal_fifo,
    idle_while_waiting,
    least_connections,
    round_robin,
    simulate_balancer,
)
from gpuhedge_celery.cli import cli


def work(arrivals, jobs, k):
    return Workload(list(arrivals), list(jobs), k, 0.9, statistics.fmean(jobs))


def test_workload_is_seeded_poisson_with_the_requested_mean():
    a = Workload.generate(k=8, rho=0.9, n=20_000, mean_job_s=0.5, sigma=1.0, seed=3)
    assert a == Workload.generate(k=8, rho=0.9, n=20_000, mean_job_s=0.5, sigma=1.0, seed=3)
    assert abs(statistics.fmean(a.jobs) - 0.5) < 0.03
    rate = len(a.arrivals) / a.arrivals[-1]
    assert abs(rate - 0.9 * 8 / 0.5) / (0.9 * 8 / 0.5) < 0.03


def test_ideal_fifo_by_hand():
    # two GPUs; the third request waits for the first to finish at t=2
    records = ideal_fifo(work([0, 0, 1], [2, 3, 1], 2))
    assert [(r.start, r.end) for r in records] == [(0, 2), (0, 3), (2, 3)]


def test_round_robin_queues_behind_a_busy_gpu_while_another_idles():
    w = work([0, 0.1, 0.2], [5, 0.1, 0.1], 2)
    records = simulate_balancer(w, round_robin, stale_s=0)
    assert records[2].gpu == 0 and records[2].start == 5  # behind the long job
    assert idle_while_waiting(records, 2) > 4  # GPU 1 idled while request 2 waited
    assert idle_while_waiting(ideal_fifo(w), 2) == 0


def test_least_connections_with_a_stale_view_misses_completions():
    # GPU 0 finishes its first job at t=1, but a balancer that last looked at t=0 still counts
    # it as busy and alternates; a fresh view sends the t=2 request back to the idle GPU 0.
    w = work([0, 2, 2.1, 2.2], [1, 1, 5, 1], 2)
    assert [r.gpu for r in simulate_balancer(w, least_connections, stale_s=100)] == [0, 1, 0, 1]
    assert [r.gpu for r in simulate_balancer(w, least_connections, stale_s=0)] == [0, 0, 1, 0]


def test_idle_while_waiting_counts_min_of_idle_and_waiting():
    records = [Record(0, 0, 10, 0), Record(0, 3, 4, 1)]  # GPU 1 idle for 3 s while one waits
    assert idle_while_waiting(records, 2) == 3


def test_command_prints_the_agreed_json(redis_url):
    result = CliRunner().invoke(
        cli,
        ["--redis-url", redis_url, "bench", "pool", "--json", "--rho", "0.5",
         "--requests", "12", "--mean-job-s", "0.2"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["bench"] == "pool" and report["k"] == 8 and report["compression"] == 50
    assert "no Celery worker" in report["harness"]
    rows = {r["scheduler"]: r for r in report["results"]}
    assert set(rows) == {"lease", "round_robin", "least_connections", "ideal"}
    for row in rows.values():
        assert row["rho"] == 0.5 and row["n"] == 12
        assert row["mean_wait_s"] >= 0 and row["p95_wait_s"] >= 0
        assert row["idle_while_waiting_s"] >= 0
    assert rows["lease"]["mode"] == "measured" and rows["ideal"]["mode"] == "computed"


def test_command_rejects_bad_load(redis_url):
    result = CliRunner().invoke(cli, ["--redis-url", redis_url, "bench", "pool", "--rho", "1"])
    assert result.exit_code == 2 and "--rho" in result.output


class _Result:
    def __init__(self, out):
        self.out = out

    def get(self, timeout):
        return self.out

    def forget(self):
        pass


def test_runner_overhead_split_adds_up(monkeypatch):
    from gpuhedge_celery.bench._pool_runners import measure_job, summary

    def out_of(sent):  # leased 3 ms after sending, started 2 ms later, ran 5 ms (1 ms compute)
        return {"started_at": sent + 0.005, "dispatch_s": 0.002, "run_s": 0.005, "attempt": 0,
                "output": {"compute_s": 0.001}}  # fmt: skip

    monkeypatch.setattr(time, "time", lambda: 1_000.0)  # the wall clock stands still: the
    # split is exact, whatever a loaded machine does between sending and answering
    row = measure_job(lambda: _Result(out_of(time.time())), 1.0)
    assert row["lease_ms"] == pytest.approx(3) and row["dispatch_ms"] == 2 and row["runner_ms"] == 4
    assert row["compute_ms"] == 1 and row["overhead_ms"] == row["e2e_ms"] - 1
    parts = row["lease_ms"] + row["dispatch_ms"] + row["result_ms"]
    assert abs(parts - row["scheduling_ms"]) < 1e-6
    assert abs(row["scheduling_ms"] + row["runner_ms"] + row["compute_ms"] - row["e2e_ms"]) < 1e-6
    text = measure_job(lambda: _Result({**out_of(time.time()), "output": "text"}), 1.0)
    assert text["compute_ms"] == 5 and text["runner_ms"] == 0, "no compute_s: all of run_s"
    assert summary([1, 2, 3, 4]) == {"p50": 2, "p95": 4, "max": 4, "mean": 2.5}


def test_runner_overhead_on_real_workers(redis_url):
    out = CliRunner().invoke(
        cli,
        ["--redis-url", redis_url, "bench", "pool", "--json", "--runner", "cpu:fixed=0.01",
         "--jobs", "5", "--warmup", "1"],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)["results"]
    assert [row["dispatch"] for row in rows] == ["queued", "direct"]  # side by side
    for row in rows:
        assert row["runner"] == "cpu:fixed=0.01" and row["jobs"] == 5 and row["retried"] == 0
        assert row["compute_ms"]["p50"] >= 10 and row["overhead_ms"]["p50"] > 0
        assert row["e2e_ms"]["p50"] >= row["compute_ms"]["p50"]
