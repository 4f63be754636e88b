#!/usr/bin/env python3
"""How many of the store-level tests pass with their Redis on a Redis Cluster, and why the
others fail: a measure of how far the store is from running on a cluster.

Runs the modules below, or those given, in the ``redis`` tier without Celery workers, the way the
suite runs a module's ``[cluster]`` variant (``GPUHEDGE_TEST_BROKER=cluster``): the store on a
three-master cluster on loopback (the ``redis_cluster`` fixture), Celery's broker and results on
the plain redis-server, as a cluster store requires. A test that builds its own client with
``redis.Redis.from_url`` from the cluster's URL gets the cluster client of ``store/cluster.py``.
The tests' races run on ``GPUHEDGE_RACE_SHARDS`` race shards, by default a cluster's (3). Prints
JSON: how many passed and failed, the failures grouped by kind (with a few tests of each), and
for cross-slot pipelines the key pairs that met.

Usage: ``PYTHONPATH=. python3 scripts/cluster_compat.py [MODULE ...]``. The same file is the
pytest plugin the run loads (``-p cluster_compat``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = [
    "tests/test_race_store.py",
    "tests/test_race_parts.py",
    "tests/test_races_driver.py",
    "tests/test_race_timer_shards.py",
    "tests/test_race_stop.py",
    "tests/test_races_replica_wait.py",
    "tests/test_watch_batch.py",
    "tests/test_race_event_batches.py",
    "tests/test_race_backend.py",
    "tests/test_leases.py",
    "tests/test_fence_tokens.py",
    "tests/test_lease_contention.py",
    "tests/test_waiter.py",
    "tests/test_waiter_liveness.py",
    "tests/test_listener.py",
    "tests/test_drain.py",
    "tests/test_budget_store.py",
    "tests/test_budget_bounded.py",
    "tests/test_budget_round_trips.py",
    "tests/test_budget_settle_on_save.py",
    "tests/test_timers.py",
    "tests/test_timers_service.py",
    "tests/test_records.py",
    "tests/test_adaptive_store.py",
    "tests/test_pool_direct.py",
    "tests/test_metrics_record.py",
    "tests/test_runpod_ratelimit.py",
]
RESULTS_VAR = "GPUHEDGE_CLUSTER_COMPAT_RESULTS"

# (kind, pattern in the failure's text), first match wins
KINDS = [
    ("cross-slot pipeline", r"a cluster pipeline keeps to one slot"),
    ("script keys in two slots", r"all keys must map to the same key slot|CROSSSLOT"),
    ("script touches a key not in KEYS", r"non local key|undeclared key|access a non local"),
    ("keyless single command", r"No way to dispatch this command"),
    ("test builds a plain client", r"Redis URL must specify one of the following schemes"),
    ("a Celery app on the cluster", r"names a Redis Cluster, which Celery cannot use"),
    ("reads the client's class", r"'ClusterClient' has no attribute"),
    ("connection_pool read", r"has no attribute 'connection_pool'|connection_kwargs"),
    ("keyspace events / pub-sub", r"notify-keyspace-events|keyspace|__keyevent|pubsub"),
    ("timed out", r"Timeout|timed out|not reached within"),
]


# --- the pytest plugin (loaded in the test run) ---


def pytest_configure(config):  # noqa: ARG001
    import redis

    from gpuhedge_celery.redis_url import is_cluster
    from gpuhedge_celery.store.connection import redis_from_url

    plain = redis.Redis.from_url.__func__

    def from_url(cls, url, **kwargs):
        if is_cluster(url):
            return redis_from_url(url, **kwargs)
        return plain(cls, url, **kwargs)

    redis.Redis.from_url = classmethod(from_url)


def pytest_runtest_logreport(report):
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        with open(os.environ[RESULTS_VAR], "a") as out:
            text = report.longreprtext if report.outcome == "failed" else ""
            out.write(json.dumps([report.nodeid, report.outcome, text]) + "\n")


# --- the script ---


def _kind(text: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, text):
            return kind
    lines = [line for line in text.splitlines() if line.startswith("E ")]
    return "other: " + (lines[0][1:].strip()[:120] if lines else text.strip()[-120:])


def _pattern(key: str) -> str:
    """A key with its ids left out: ``t1a2b:race:{r-7}:state`` -> ``*:race:{*}:state``."""
    key = re.sub(r"\{[^}]*\}", "{*}", key)
    return re.sub(r"^t[0-9a-f]{10}", "*", key)


def _pairs(text: str) -> str | None:
    found = re.search(r"names '([^']*)' \(slot \d+\) and '([^']*)' \(slot \d+\)", text)
    return f"{_pattern(found[1])} + {_pattern(found[2])}" if found else None


def main(modules: list[str]) -> dict[str, object]:
    sys.path.insert(0, str(ROOT))
    from gpuhedge_celery.envvars import REDIS_URL_VAR, race_shards

    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.jsonl"
        # as many race shards as a deployment on a cluster would run (the tests' drivers)
        shards = race_shards({**os.environ, REDIS_URL_VAR: "redis+cluster://127.0.0.1:7000"})
        env = {
            **os.environ,
            "GPUHEDGE_RACE_SHARDS": str(shards),
            "GPUHEDGE_TEST_BROKER": "cluster",
            RESULTS_VAR: str(results),
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")]),
        }
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
             "cluster_compat", "-m", "redis and not celery and not slow", "--timeout", "60",
             *modules],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, check=False,
        )  # fmt: skip
        rows = [json.loads(line) for line in results.read_text().splitlines()]
    outcomes = Counter(outcome for _, outcome, _ in rows)
    kinds: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}
    pairs: Counter[str] = Counter()
    per_module: dict[str, Counter[str]] = {}
    for nodeid, outcome, text in rows:
        per_module.setdefault(nodeid.split("::")[0], Counter())[outcome] += 1
        if outcome == "failed":
            kind = _kind(text)
            kinds[kind] += 1
            examples.setdefault(kind, [])
            if len(examples[kind]) < 3:
                examples[kind].append(nodeid)
            pair = _pairs(text)
            if pair:
                pairs[pair] += 1
    return {
        "race_shards": shards,
        "tests": len(rows),
        "passed": outcomes["passed"],
        "failed": outcomes["failed"],
        "skipped": outcomes["skipped"],
        "failure_kinds": dict(kinds.most_common()),
        "examples": examples,
        "cross_slot_pairs": dict(pairs.most_common()),
        "per_module": {m: dict(c) for m, c in sorted(per_module.items())},
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:] or MODULES), indent=2))
