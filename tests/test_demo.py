"""The README's main command: ``gpuhedge-celery demo`` on the embedded Redis, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


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


@pytest.fixture(scope="module")
def demo_on_embedded():
    """One run of the demo on its embedded Redis, shared by the tests that read it."""
    return _run_demo("demo", "--races", "3", "--pool-jobs", "4", "--json")


def test_demo_runs_every_scenario_on_the_embedded_redis(demo_on_embedded):
    proc = demo_on_embedded
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


def test_demo_says_what_its_times_mean_and_that_the_embedded_redis_goes(demo_on_embedded):
    proc = demo_on_embedded
    text = proc.stderr
    assert "simulated time runs 10x faster than the wall clock" in text
    assert "embedded Redis goes away when the demo ends" in text
    assert "--redis-url URL receipt" not in text and "receipt RACE_ID" not in text
    # the receipt shown is in simulated seconds, as the narration, and says so
    latency = next(line for line in text.splitlines() if line.strip().startswith("latency"))
    assert "s simulated from the primary's submit" in latency and "10x fast" in latency
    assert "timeline (simulated s): " in text and " ms " not in latency
    # the lease table's header lines up with its rows
    lines = text.splitlines()
    top = next(i for i, line in enumerate(lines) if "lease table while jobs run" in line)
    header, rows = lines[top + 1], lines[top + 2 : top + 4]
    starts = [header.index(name) for name in ("POOL", "HOST", "STATE", "HOLDER", "TOKEN")]
    for row in rows:
        assert row.lstrip().startswith("demo-host:"), row
        for start in starts:
            assert row[start - 1] == " " and row[start] != " ", (header, row)


def test_demo_on_a_real_redis_leaves_only_its_receipts_with_a_ttl(private_redis, capsys):
    import redis

    from gpuhedge_celery.cli import main
    from gpuhedge_celery.demo.cleanup import RECEIPT_TTL_S

    url = private_redis.url
    proc = _run_demo("--redis-url", url, "demo", "--races", "2", "--pool-jobs", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    prefix = report["prefix"]
    assert f"gpuhedge-celery --redis-url {url} --prefix {prefix} receipt RACE_ID" in proc.stderr
    client = redis.Redis.from_url(url, decode_responses=True)
    left = sorted(client.scan_iter("*", count=1000))
    races = len(report["scenarios"]) + 2 * len(report["summary"]) + len(report["pool_races"])
    assert len(left) == races == report["cleanup"]["receipts_kept"], left
    assert report["cleanup"]["deleted"] > races  # everything else it wrote is gone
    for key in left:
        assert key.startswith(f"{prefix}:race:{{") and key.endswith(":receipt"), key
        assert 0 < client.pttl(key) <= RECEIPT_TTL_S * 1000, key
    # and each can be read as the demo says, by the short id watch shows
    race_id = report["scenarios"][0]["race_id"]
    code = main(["--redis-url", url, "--prefix", prefix, "receipt", race_id[:12], "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["race_id"] == race_id


def test_demo_on_a_cluster_store_wins_its_races_runs_the_pool_and_leaves_only_receipts(
    redis_cluster, plain_redis_url
):
    """The store on a Redis Cluster, the broker and Celery's results on a plain Redis: every
    section runs, and the demo's keys are gone from both but its receipts (on the cluster)."""
    import redis

    from gpuhedge_celery.demo.cleanup import RECEIPT_TTL_S
    from gpuhedge_celery.store.connection import redis_from_url

    url = redis_cluster.url
    proc = _run_demo(
        "--redis-url", url, "demo", "--races", "2", "--pool-jobs", "2", "--json",
        env_extra={"GPUHEDGE_BROKER_URL": plain_redis_url},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    prefix = report["prefix"]
    winners = {s["sim_key"]: s["winner"] for s in report["scenarios"]}
    assert winners == {0: "sim-cheap", 1: "sim-steady", 2: "sim-steady", 3: "sim-steady",
                       4: "sim-reserve"}  # fmt: skip
    assert not any(s["leaked"] for s in report["scenarios"])
    assert all(row["n"] == 2 and row["leaks"] == 0 for row in report["summary"])
    cases = {r["case"]: r for r in report["pool_races"]}
    assert cases["free"]["winner"] == "gpu-pool" and cases["saturated"]["winner"] == "sim-steady"
    assert len(report["pool"]) == 2 and len({job["gpu"] for job in report["pool"]}) == 2
    store = redis_from_url(url, decode_responses=True)
    left = sorted(store.scan_iter(f"{prefix}:*", count=1000))
    races = len(report["scenarios"]) + 2 * len(report["summary"]) + len(report["pool_races"])
    assert len(left) == races == report["cleanup"]["receipts_kept"], left
    for key in left:
        assert key.startswith(f"{prefix}:race:{{") and key.endswith(":receipt"), key
        assert 0 < store.pttl(key) <= RECEIPT_TTL_S * 1000, key
    store.close()
    broker = redis.Redis.from_url(plain_redis_url)
    assert list(broker.scan_iter(f"{prefix}:*", count=1000)) == []  # queues and results too
    broker.close()


def test_demo_with_unreachable_redis_is_one_line_exit_3():
    proc = _run_demo("--redis-url", "redis://127.0.0.1:1/0", "demo")
    assert proc.returncode == 3
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unreachable" in lines[0]


def test_demo_on_a_cluster_store_without_a_broker_is_one_line_exit_2(redis_cluster):
    proc = _run_demo("--redis-url", redis_cluster.url, "demo")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "GPUHEDGE_BROKER_URL" in lines[0], lines
    assert redis_cluster.password not in proc.stderr


def test_every_doc_states_the_demo_time_scale_its_config_has():
    """The demo's speed-up is written in many places; each must say what demo.yaml says."""
    import re
    from pathlib import Path

    from gpuhedge_celery.config import load_config, packaged_path

    scale = load_config(packaged_path("demo.yaml")).time_scale
    root = Path(__file__).resolve().parents[1]
    files = [
        root / "README.md",
        *sorted((root / "docs").glob("*.md")),
        *sorted((root / "examples").rglob("*.md")),
        *sorted((root / "gpuhedge_celery").rglob("*.py")),
        packaged_path("demo.yaml"),
    ]
    claims = 0
    for path in files:
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"(\d+(?:\.\d+)?)\s*(?:x|×)\s+fast", text):
            claims += 1
            assert float(m.group(1)) == 1 / scale, f"{path}: {m.group(0)!r}"
        for m in re.finditer(r"demo\W[^\n]{0,80}?time_scale[ :`]+(\d*\.\d+)", text):
            claims += 1
            assert float(m.group(1)) == scale, f"{path}: {m.group(0)!r}"
    assert claims >= 4  # the README, the docs, the example, the demo itself
