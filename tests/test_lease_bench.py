"""``gpuhedge-celery bench handoff`` runs end to end and prints the agreed JSON shape.

Not a timing test: the figures go to docs/benchmarks.md from a full run.
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from gpuhedge_celery.cli import cli


def test_bench_handoff_json_shape(redis_url):
    out = CliRunner().invoke(
        cli,
        [
            "--redis-url", redis_url, "bench", "handoff", "--json",
            "--n", "5", "--expiries", "3", "--background-keys", "100",
            "--dead-heads", "3", "--lapsed-heads", "2", "--lapse-s", "1.2",
        ],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["bench"] == "handoff"
    methods = [r["method"] for r in report["results"]]
    assert methods == [
        "keyspace", "poll-10ms", "poll-100ms", "redis-rtt", "expiry", "dead-head",
        "dead-head-lapsed", "paused-head",
    ]  # fmt: skip
    for r in report["results"]:
        assert r["n"] >= 2 and 0 <= r["p50_ms"] <= r["p99_ms"]
    expiry = report["results"][4]
    assert expiry["volatile_keys"] >= 100
    # Held from the deadline on: a waiter that only slept its re-check (1 s) would be far later.
    assert expiry["p99_ms"] < 900
    # Past a killed head waiter: not held up until the dead waiter's entry ages out (seconds).
    dead, lapsed, paused = report["results"][5:]
    assert max(dead["max_ms"], lapsed["max_ms"], paused["max_ms"]) < 1000
    assert lapsed["released_after_kill_s"] == 1.2
