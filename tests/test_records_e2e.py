"""Records end to end: races on real Celery workers append records; export -> report works.

Two real coordination workers race sim providers on compressed time
(``tests/support/fixtures_races.py``). Each finished race must leave one record in the stream
that agrees with its receipt; ``records export --since`` must write exactly this test's races,
and ``report`` over the exported file must count them by policy.
"""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from gpuhedge_celery.cli import cli
from gpuhedge_celery.errors import RaceFailed

pytestmark = [pytest.mark.timeout(120), pytest.mark.celery, pytest.mark.cluster]

FAST = {"sim": {"p": {"queue_s": 0, "run_s": 1}}}
SLOW_PRIMARY = {"sim": {"p": {"queue_s": 2, "run_s": 100}, "h": {"queue_s": 0.5, "run_s": 4}}}
QUEUED_PRIMARY = {"sim": {"p": {"queue_s": 30, "run_s": 5}, "h": {"queue_s": 0.5, "run_s": 4}}}
BOTH_FAIL = {
    "sim": {
        "p": {"queue_s": 0.5, "run_s": 1, "outcome": "failed"},
        "h": {"queue_s": 0.5, "run_s": 1, "outcome": "failed"},
    }
}


def test_races_append_records_and_export_then_report_summarises_them(race_cluster, tmp_path):
    rc = race_cluster
    time.sleep(0.01)
    since = time.time()  # the fixture's warm-up races finished before this
    started = {
        "fast": rc.send(FAST),
        "hedged": rc.send(SLOW_PRIMARY),
        "cut_over": rc.send(QUEUED_PRIMARY, policy="state_aware"),
        "failed": rc.send(BOTH_FAIL),
    }
    receipts = {}
    try:
        for name, res in started.items():
            if name == "failed":
                with pytest.raises(RaceFailed):
                    res.get(timeout=20)
            else:
                res.get(timeout=20)
            receipts[name] = rc.receipt(res.id)  # written with the record, in one round trip
    except Exception:
        print(rc.logs())
        raise

    records = {r["race_id"]: r for _, r in rc.store.records.read(int(since * 1000))}
    assert set(records) == {res.id for res in started.values()}
    for name, res in started.items():
        record, receipt = records[res.id], receipts[name]
        assert record["winner"] == receipt["winner_provider"]
        assert record["policy"] == receipt["policy"]
        for flag in ("hedged", "cut_over", "escalated", "leaked"):
            assert record[flag] == receipt[flag], (name, flag)
        assert record["usd"] == pytest.approx(receipt["active_usd"], abs=1e-6)
        assert record["wasted_usd"] == pytest.approx(receipt["wasted_usd"], abs=1e-6)
        assert [a["provider"] for a in record["attempts"]] == [
            a["provider"] for a in receipt["attempts"]
        ]
    hedged = records[started["hedged"].id]
    assert hedged["winner"] == "h" and hedged["hedged"] and hedged["wasted_usd"] > 0
    assert hedged["cancels"] == [
        {"provider": "p", "evidence": "confirmed_terminal", "was_running": True,
         "terminal": "CANCELLED", "ack_ms": hedged["cancels"][0]["ack_ms"], "leaked": False}
    ]  # fmt: skip
    cut = records[started["cut_over"].id]
    assert cut["cut_over"] and cut["cancels"][0]["was_running"] is False
    failed = records[started["failed"].id]
    assert failed["winner"] is None and failed["e2e_ms"] is None
    assert [a["state"] for a in failed["attempts"]] == ["FAILED", "FAILED"]

    # export what this test ran, then report on the file
    exported = tmp_path / "records.jsonl"
    args = ["--redis-url", rc.redis_url, "--prefix", rc.prefix, "records", "export"]
    result = CliRunner().invoke(cli, [*args, "--since", str(since)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    exported.write_text(result.stdout)
    assert len(exported.read_text().splitlines()) == 4
    result = CliRunner().invoke(
        cli, ["report", str(exported), "--json", "--deadline", "60"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    groups = {g["group"]: g for g in doc["groups"]}
    fixed, cutover = groups[receipts["fast"]["policy"]], groups[receipts["cut_over"]["policy"]]
    assert set(groups) == {receipts["fast"]["policy"], receipts["cut_over"]["policy"]}
    assert (fixed["n"], fixed["failed"], fixed["hedged"], fixed["leaks"]) == (3, 1, 2, 0)
    assert fixed["misses"] == {"60": 1}  # the failed race; the others took well under 60 s
    assert fixed["p50_s"] < 60 and fixed["p99_s"] is None  # +inf: the failed race
    assert fixed["wasted_usd"] == pytest.approx(
        sum(records[started[n].id]["wasted_usd"] for n in ("fast", "hedged", "failed"))
    )
    assert (cutover["n"], cutover["hedged"], cutover["failed"]) == (1, 1, 0)
    by_provider = CliRunner().invoke(cli, ["report", str(exported), "--by", "provider", "--json"])
    counts = {g["group"]: g["n"] for g in json.loads(by_provider.output)["groups"]}
    assert counts == {"h": 2, "p": 1, "-": 1}
