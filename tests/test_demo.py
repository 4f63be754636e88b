"""The README's main command: ``gpuhedge-celery demo`` on the embedded Redis, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys


def _run_demo(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUHEDGE_")}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "gpuhedge_celery", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )


def test_demo_runs_every_scenario_on_the_embedded_redis():
    proc = _run_demo("demo", "--races", "3", "--pool-jobs", "4", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["redis"].startswith("embedded fakeredis")
    by_key = {s["sim_key"]: s for s in report["scenarios"]}
    assert by_key[0]["winner"] == "sim-cheap"  # fast path
    assert by_key[1]["winner"] == "sim-steady" and by_key[1]["hedged"]  # hedge rescue
    assert by_key[2]["winner"] == "sim-steady"  # the validator rejected the primary
    assert by_key[3]["cut_over"] and by_key[3]["winner"] == "sim-steady"
    assert by_key[4]["escalated"] and by_key[4]["winner"] == "sim-reserve"
    assert not any(s["leaked"] for s in report["scenarios"])
    assert [row["policy"] for row in report["summary"]] == [
        "single",
        "fixed",
        "state_aware",
        "cascade",
    ]
    assert all(row["n"] == 3 and row["leaks"] == 0 for row in report["summary"])
    # the pool as a race provider: wins when a GPU is free, bursts to the sim when saturated
    cases = {r["case"]: r for r in report["pool_races"]}
    assert cases["free"]["winner"] == "gpu-pool"
    assert cases["saturated"]["cut_over"] and cases["saturated"]["winner"] == "sim-steady"
    assert not any(r["leaked"] for r in report["pool_races"])
    # the pool: each GPU ran its jobs one at a time, under strictly increasing fencing tokens
    per_gpu: dict[str, list[dict]] = {}
    for job in report["pool"]:
        per_gpu.setdefault(job["gpu"], []).append(job)
    assert len(report["pool"]) == 4 and len(per_gpu) == 2
    for jobs in per_gpu.values():
        jobs.sort(key=lambda j: j["token"])
        tokens = [j["token"] for j in jobs]
        assert tokens == sorted(set(tokens))
        for a, b in zip(jobs, jobs[1:], strict=False):
            assert b["started_s"] >= a["started_s"] + a["run_s"] - 0.05


def test_demo_with_unreachable_redis_is_one_line_exit_3():
    proc = _run_demo("--redis-url", "redis://127.0.0.1:1/0", "demo")
    assert proc.returncode == 3
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unreachable" in lines[0]
