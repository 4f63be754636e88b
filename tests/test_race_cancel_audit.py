"""Races replayed with the cancel latencies GPUHedge measured (tests/data/cancel_audit.jsonl)."""

from __future__ import annotations

import json
import pathlib

import pytest

from gpuhedge_celery.core.outcome import race_outcome
from gpuhedge_celery.core.policies import parse_policy
from gpuhedge_celery.core.scripted import Arm, run_race

AUDIT = pathlib.Path(__file__).parent / "data" / "cancel_audit.jsonl"


def runpod_cancels():
    for line in AUDIT.read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "forced_cancel" and record["provider"] == "runpod":
            yield record


RECORDS = list(runpod_cancels())


def test_audit_has_the_documented_runpod_records():
    assert len(RECORDS) == 4
    assert {r["state_before_cancel"] for r in RECORDS} == {"IN_QUEUE", "IN_PROGRESS"}


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: f"{r['phase']}-{r['attempt']}")
def test_loser_stays_live_until_its_measured_terminal_time(record):
    receipt = record["receipt"]
    ack_s = (receipt["cancel_ack_ms"] - receipt["cancel_sent_ms"]) / 1000
    terminal_s = (receipt["terminal_ms"] - receipt["cancel_sent_ms"]) / 1000
    cancel_at = record["cancel_at_s"]
    queued = record["state_before_cancel"] == "IN_QUEUE"
    # The RunPod arm is the slow primary; the hedge wins exactly at the audited cancel time.
    primary = Arm(
        "runpod",
        120.0,
        queue_delay_s=cancel_at + 5 if queued else 0.5,
        cancel_ack_s=ack_s,
        cancel_terminal_s=terminal_s,
    )
    hedge = Arm("modal", cancel_at)
    live_when: list[tuple[float, int]] = []
    race = run_race(
        parse_policy("hedge:runpod->modal@0s"),
        {"runpod": primary, "modal": hedge},
        after_event=lambda r: live_when.append((r.clock.now(), r.live_count)),
    )
    loser = race.attempt_for("primary")
    r = loser.receipt
    assert race.winner_attempt.provider == "modal"
    assert r.cancel_ack_ms - r.cancel_sent_ms == pytest.approx(ack_s * 1000)
    assert r.terminal_ms - r.cancel_sent_ms == pytest.approx(terminal_s * 1000)
    assert r.evidence.value == "confirmed_terminal" and not r.leaked
    assert r.was_running is (not queued)
    # between the win and the observed terminal state the loser still holds a live slot
    assert any(cancel_at <= t < cancel_at + terminal_s and n == 1 for t, n in live_when)
    outcome = race_outcome(race, {"runpod": _rate(), "modal": _rate()})
    assert (outcome.wasted_usd == 0.0) is queued


def _rate():
    from gpuhedge_celery.core.rates import ProviderRate

    return ProviderRate(0.000306, 60.0)
