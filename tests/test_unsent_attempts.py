"""An attempt never sent to its provider is no hedge: one definition of "hedged", used by the
engine's outcome, the caller's result, the record, the replay and the Flower/metrics events.

Pure engine on a virtual clock; the same race with real Celery workers and a budget that
refuses the hedge is ``tests/test_budget_races.py``.
"""

from __future__ import annotations

import pytest

from gpuhedge_celery.core.attempts import hedged
from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.core.outcome import race_outcome
from gpuhedge_celery.core.policies import parse_policy
from gpuhedge_celery.core.race import BUDGET_REFUSED, Race
from gpuhedge_celery.core.race_events import (
    AttemptSubmitted,
    Launch,
    ResultArrived,
    SubmitFailed,
    TimerDue,
    event_from_dict,
)
from gpuhedge_celery.core.rates import ProviderRate
from gpuhedge_celery.core.receipts import Evidence
from gpuhedge_celery.core.records import build_record
from gpuhedge_celery.core.replay import Round, replay_round
from gpuhedge_celery.core.report import from_ours, summarise_group
from gpuhedge_celery.core.scripted import Arm
from gpuhedge_celery.race.receipt import winner_result

RATES = {"p": ProviderRate(0.0003, 60.0), "h": ProviderRate(0.0007)}
REFUSAL = "budget: refused by max_usd_per_request: $0.1 cap, $0.048 reserved or spent, ..."


def primary_slow_race(hedge_event) -> Race:
    """``hedge:p->h@10s``: the hedge is launched at 10 s and answered with ``hedge_event``
    (None: left launching); the primary wins alone at 60 s."""
    clock = VirtualClock()
    race = Race(parse_policy("hedge:p->h@10s"), clock, race_id="r1")
    race.start()
    race.handle(AttemptSubmitted("a1", "job-p"))
    clock.set(10.0)
    assert race.handle(TimerDue("hedge")) == [Launch("a2", "h", "hedge")]
    clock.set(10.1)
    if hedge_event is not None:
        race.handle(hedge_event)
    clock.set(60.0)
    race.handle(ResultArrived("a1"))
    return race


def refused_hedge_race() -> Race:
    return primary_slow_race(SubmitFailed("a2", REFUSAL, refused=True))


def test_a_hedge_the_budget_refused_is_no_hedge_and_its_receipt_says_not_sent():
    race = refused_hedge_race()
    assert race.finished and race.winner == "a1" and BUDGET_REFUSED in race.flags
    hedge = race.attempt_for("hedge")
    assert not hedge.sent and hedge.result_state is None and hedge.submitted_at is None
    assert not hedged(race.attempts)
    out = race_outcome(race, RATES).to_dict()
    assert out["hedged"] is False and out["budget_refused"] is True
    assert out["escalated"] is False
    summary = next(a for a in out["attempts"] if a["role"] == "hedge")
    assert summary["sent"] is False and summary["state"] is None
    assert next(a for a in out["attempts"] if a["role"] == "primary")["sent"] is True
    # its receipt: nothing was cancelled, nothing confirmed, nothing cost, nothing leaked
    receipt = hedge.receipt
    assert receipt.evidence is Evidence.NO_EVIDENCE and not receipt.confirmed_terminal
    assert receipt.terminal_status is None and receipt.cancel_sent_ms is None
    assert receipt.leaked is False and receipt.estimated_cost_usd == 0.0
    assert receipt.note == f"not sent: {REFUSAL}"
    assert "leaked" not in race.flags
    # wasted $: the hedge never ran, so the loser's cost is nothing
    assert out["wasted_usd"] == 0.0


def test_a_hedge_that_was_sent_still_reads_hedged():
    race = primary_slow_race(AttemptSubmitted("a2", "job-h"))
    hedge = race.attempt_for("hedge")
    assert hedge.sent and hedged(race.attempts)
    out = race_outcome(race, RATES).to_dict()
    assert out["hedged"] is True and out["budget_refused"] is False
    assert hedge.receipt.evidence is not Evidence.NO_EVIDENCE or hedge.receipt.leaked
    assert out["wasted_usd"] > 0


def test_a_hedge_the_provider_refused_was_sent():
    # it reached the provider, which answered with an error: a hedge that failed, not unsent
    race = primary_slow_race(SubmitFailed("a2", "HTTP 500"))
    assert race.attempt_for("hedge").sent and race_outcome(race).hedged is True
    assert race_outcome(race).budget_refused is False


def test_a_hedge_the_race_no_longer_needed_is_no_hedge():
    race = primary_slow_race(SubmitFailed("a2", "not submitted: not needed", unsent=True))
    out = race_outcome(race).to_dict()
    assert out["hedged"] is False and out["budget_refused"] is False
    assert race.attempt_for("hedge").receipt.note.startswith("not sent: not submitted")


def test_a_hedge_still_launching_when_the_primary_wins_counts_as_hedged():
    # its submit may be under way: counted against us, as every unknown is
    race = primary_slow_race(None)
    assert not race.finished and race.attempt_for("hedge").sent
    assert race_outcome(race).hedged is True


def test_unsent_survives_a_save_and_the_submit_failed_message():
    race = refused_hedge_race()
    again = Race.from_dict(race.to_dict(), VirtualClock())
    assert not again.attempt_for("hedge").sent and not hedged(again.attempts)
    event = SubmitFailed("a2", "gone", unsent=True)
    assert event_from_dict(event.to_dict()) == event


def test_the_callers_result_and_the_record_agree_with_the_receipt():
    sent_race = primary_slow_race(AttemptSubmitted("a2", "job-h"))
    for race, hedge_sent in ((refused_hedge_race(), False), (sent_race, True)):
        result = winner_result(race, {"payload": "x"}, inline_max=-1, ref="k")
        out = race_outcome(race, RATES).to_dict()
        assert result["hedged"] is out["hedged"] is hedge_sent
        assert result["budget_refused"] is out["budget_refused"] is (not hedge_sent)
        record = build_record(race, out, RATES)
        assert record["hedged"] is hedge_sent and record["budget_refused"] is (not hedge_sent)
        roles = {a["role"]: a for a in record["attempts"]}
        if hedge_sent:
            assert "sent" not in roles["hedge"]
            assert [c["provider"] for c in record["cancels"]] == ["h"]
        else:
            assert roles["hedge"]["sent"] is False and roles["hedge"]["state"] is None
            assert roles["hedge"]["usd"] == 0.0 and record["cancels"] == []
        # report's hedge rate is read from the record
        request = from_ours({**record, "e2e_ms": 1.0}, "<test>")
        assert summarise_group("g", [request], (60.0,))["hedge_rate"] == (
            1.0 if hedge_sent else 0.0
        )


def test_the_replay_counts_hedges_by_the_same_definition():
    # the primary's recorded run is slow, so the hedge fires; a primary fast enough never hedges
    slow = Round(1, {"p": Arm("p", wall_s=60.0), "h": Arm("h", wall_s=5.0)})
    fast = Round(2, {"p": Arm("p", wall_s=1.0), "h": Arm("h", wall_s=5.0)})
    policy = parse_policy("hedge:p->h@10s")
    for rnd, expected in ((slow, True), (fast, False)):
        result = replay_round(policy, rnd, RATES)
        assert result.hedged is expected
        assert result.hedged is hedged(result.race.attempts) is race_outcome(result.race).hedged


@pytest.mark.parametrize("sent", [True, False])
def test_hedge_launched_is_announced_only_for_a_hedge_that_was_sent(sent):
    from gpuhedge_celery.race.outcome import Outcome

    class Announcer(Outcome):
        def __init__(self):
            super().__init__(driver=None)  # only its events are looked at
            self.events = []

        def event(self, race_id, name, race, attempt_id):
            self.events.append((name, attempt_id))

    clock = VirtualClock()
    race = Race(parse_policy("hedge:p->h@10s"), clock, race_id="r1")
    race.start()
    race.handle(AttemptSubmitted("a1", "job-p"))
    clock.set(10.0)
    race.handle(TimerDue("hedge"))
    work = Announcer()
    launched = {a.id: a.phase for a in race.attempts}
    work.announce_sent("r1", race, {})  # the step that launched it: not sent yet
    assert work.events == []
    race.handle(AttemptSubmitted("a2", "job-h") if sent else SubmitFailed("a2", "no", refused=True))
    work.announce_sent("r1", race, launched)
    assert work.events == ([("hedge_launched", "a2")] if sent else [])
