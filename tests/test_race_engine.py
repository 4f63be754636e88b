"""The race engine driven event by event: resumption, idempotency, custom policies, messages."""

from __future__ import annotations

import json

import pytest

from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.core.jobs import JobState
from gpuhedge_celery.core.outcome import race_outcome
from gpuhedge_celery.core.policies import (
    PRIMARY,
    Policy,
    parse_policy,
    policy_from_dict,
    register_policy,
)
from gpuhedge_celery.core.race import Race
from gpuhedge_celery.core.race_events import (
    AttemptSubmitted,
    Cancel,
    CancelAcknowledged,
    CancelConfirmed,
    DeclareWinner,
    Launch,
    PollStatus,
    RaceFinished,
    ResultArrived,
    ScheduleTimer,
    StatusObserved,
    TimerDue,
    action_from_dict,
    event_from_dict,
)
from gpuhedge_celery.core.receipts import CancelReceipt, Evidence
from gpuhedge_celery.core.scripted import Arm, run_race


def kinds(actions):
    return [a.kind for a in actions]


def test_fixed_hedge_step_by_step():
    clock = VirtualClock()
    race = Race(parse_policy("hedge:runpod->cerebrium@10s"), clock, race_id="r1")
    assert race.start() == [Launch("a1", "runpod", "primary")]
    clock.set(0.2)
    assert race.handle(AttemptSubmitted("a1", "job-1")) == [ScheduleTimer("hedge", 10.2)]
    clock.set(10.2)
    assert race.handle(TimerDue("hedge")) == [Launch("a2", "cerebrium", "hedge")]
    clock.set(10.3)
    assert race.handle(AttemptSubmitted("a2", "job-2")) == []
    clock.set(29.0)
    assert race.handle(ResultArrived("a2")) == [DeclareWinner("a2"), Cancel("a1", "lost")]
    assert not race.finished and race.live_count == 1  # a cancel in flight is still live
    clock.set(29.3)
    assert race.handle(CancelAcknowledged("a1")) == []
    clock.set(29.4)
    assert race.handle(CancelConfirmed("a1", JobState.CANCELLED)) == [RaceFinished("a2", "")]
    assert race.latency() == pytest.approx(28.8)  # from the primary's submit, not the start
    receipt = race.attempt_for("primary").receipt
    assert receipt.evidence is Evidence.CONFIRMED_TERMINAL and not receipt.leaked
    assert receipt.cancel_sent_ms == pytest.approx(29000) and receipt.terminal_ms == 29400


def test_duplicates_and_early_timers_are_harmless():
    clock = VirtualClock()
    race = Race(parse_policy("hedge:a->b@10s"), clock)
    race.start()
    assert race.handle(AttemptSubmitted("a1", "j")) == [ScheduleTimer("hedge", 10.0)]
    assert race.handle(AttemptSubmitted("a1", "j")) == []  # redelivered
    clock.set(4.0)
    assert race.handle(TimerDue("hedge")) == [ScheduleTimer("hedge", 10.0)]  # early: re-arm
    assert race.handle(TimerDue("nonsense")) == []
    clock.set(6.0)
    assert kinds(race.handle(ResultArrived("a1"))) == ["declare_winner", "race_finished"]
    assert race.handle(ResultArrived("a1")) == []  # after finishing, everything is ignored
    assert race.handle(TimerDue("hedge")) == []


def test_events_before_start_and_unknown_attempts_are_errors():
    race = Race(parse_policy("single:a"), VirtualClock())
    with pytest.raises(ValueError, match="before start"):
        race.handle(ResultArrived("a1"))
    race.start()
    with pytest.raises(ValueError, match="no attempt"):
        race.handle(ResultArrived("a9"))


def test_cancel_pending_primary_wins_and_hedge_is_cancelled():
    clock = VirtualClock()
    race = Race(parse_policy("cutover:a->b"), clock)
    race.start()
    race.handle(AttemptSubmitted("a1", "j1"))
    clock.set(2.5)
    assert race.handle(TimerDue("cutover")) == [PollStatus("a1")]
    out = race.handle(StatusObserved("a1", JobState.QUEUED))
    assert out == [Cancel("a1", "cutover: still queued"), Launch("a2", "b", "hedge")]
    race.handle(AttemptSubmitted("a2", "j2"))
    clock.set(3.0)
    out = race.handle(ResultArrived("a1"))  # cancel not yet confirmed: it may still win
    assert out == [DeclareWinner("a1"), Cancel("a2", "lost")]
    receipt = race.attempt_for(PRIMARY).receipt
    assert receipt.confirmed_terminal and receipt.terminal_status is JobState.COMPLETED
    assert "before the cancel took effect" in receipt.note


def test_provider_receipt_merges_without_trusting_the_cancel_reply_for_terminal_state():
    clock = VirtualClock()
    race = Race(parse_policy("hedge:a->b@0s"), clock)
    race.start()
    race.handle(AttemptSubmitted("a1", "j1"))
    race.handle(AttemptSubmitted("a2", "j2"))
    clock.set(5.0)
    race.handle(ResultArrived("a2"))
    reply = CancelReceipt(provider="a", job_id="j1", was_running=True, cancel_ack_ms=5100.0)
    reply.evidence = Evidence.CONFIRMED_TERMINAL  # a reply cannot prove a terminal state
    race.handle(CancelAcknowledged("a1", reply))
    r = race.attempt_for(PRIMARY).receipt
    assert r.evidence is Evidence.PROVIDER_ACK and r.leaked and r.terminal_status is None
    assert r.was_running is True and r.cancel_ack_ms == 5100.0
    out = race.handle(StatusObserved("a1", JobState.CANCELLED))  # a polled terminal state
    assert out == [RaceFinished("a2", "")]
    assert r.confirmed_terminal and not r.leaked


def _drive(race: Race, clock: VirtualClock, script):
    for t, event in script:
        clock.set(t)
        race.handle(event)


SCRIPT = [
    (0.1, AttemptSubmitted("a1", "j1")),
    (2.6, TimerDue("cutover")),  # policy times count from the primary's submit at 0.1
    (2.6, StatusObserved("a1", JobState.IN_PROGRESS)),
    (8.6, TimerDue("safety")),
    (8.7, AttemptSubmitted("a2", "j2")),
    (25.1, TimerDue("escalate")),
    (30.0, ResultArrived("a2", JobState.FAILED, False, ("500",))),
    (30.1, AttemptSubmitted("a3", "j3")),
    (34.0, ResultArrived("a3")),
    (34.2, CancelConfirmed("a1", JobState.CANCELLED)),
]


@pytest.mark.parametrize("cut", range(len(SCRIPT) + 1))
def test_race_resumes_in_another_process_from_its_json(cut):
    """A coordinator that crashes after any event is resumed from JSON with the same result."""
    policy = parse_policy("cascade:a->b->c")
    clock = VirtualClock()
    whole = Race(policy, clock, race_id="x")
    whole.start()
    _drive(whole, clock, SCRIPT)

    clock2 = VirtualClock()
    first = Race(policy, clock2, race_id="x")
    first.start()
    _drive(first, clock2, SCRIPT[:cut])
    saved = json.loads(json.dumps(first.to_dict()))
    resumed = Race.from_dict(saved, clock2)
    _drive(resumed, clock2, SCRIPT[cut:])
    assert resumed.to_dict() == whole.to_dict()
    assert resumed.finished and resumed.winner_attempt.provider == "c"
    assert race_outcome(resumed).escalated and race_outcome(resumed).escalation_waited


def test_events_and_actions_survive_a_json_round_trip():
    receipt = CancelReceipt(provider="a", job_id="j", was_running=False)
    events = [
        TimerDue("hedge"),
        AttemptSubmitted("a1", "j", {"provider": "a", "job_id": "j", "submitted_at": 1.0}),
        StatusObserved("a1", JobState.QUEUED),
        StatusObserved("a1", None, "timeout"),
        ResultArrived("a1", JobState.FAILED, False, ("bad wav",)),
        CancelAcknowledged("a1", receipt),
        CancelConfirmed("a1", JobState.CANCELLED),
    ]
    for event in events:
        assert event_from_dict(json.loads(json.dumps(event.to_dict()))) == event
    actions = [Launch("a1", "a", "primary"), ScheduleTimer("k", 1.5), RaceFinished(None, "x")]
    for action in actions:
        assert action_from_dict(json.loads(json.dumps(action.to_dict()))) == action
    with pytest.raises(ValueError):
        event_from_dict({"kind": "explode"})


@register_policy
class GreedyPolicy(Policy):
    """Test-only custom policy: launch every provider at once (the engine must cap it)."""

    kind = "greedy_test"

    def __init__(self, names: list[str]):
        self.names = list(names)

    def providers(self):
        return tuple(self.names)

    @property
    def name(self):
        return f"greedy_test:{','.join(self.names)}"

    def params(self):
        return {"names": self.names}

    @classmethod
    def parse(cls, body):
        return cls(body.split(","))

    def on_start(self, ctl):
        for i, provider in enumerate(self.names):
            ctl.launch(provider, "primary" if i == 0 else f"extra{i}")


def test_custom_policy_parses_resumes_and_is_capped_at_two_live_jobs():
    policy = parse_policy("greedy_test:a,b,c")
    assert isinstance(policy, GreedyPolicy)
    assert policy_from_dict(json.loads(json.dumps(policy.to_dict()))) == policy
    live: list[int] = []
    trace: list = []
    race = run_race(
        policy,
        {"a": Arm("a", 50), "b": Arm("b", 5, valid=False), "c": Arm("c", 20)},
        trace=trace,
        after_event=lambda r: live.append(r.live_count),
    )
    assert max(live) == 2
    launches = [(t, a.provider) for t, a in trace if isinstance(a, Launch)]
    assert launches == [(0, "a"), (0, "b"), (5, "c")]  # c waited for b to end
    assert race.winner_attempt.provider == "c" and race.latency() == pytest.approx(25)


def test_max_live_one_serialises_attempts():
    race = run_race(
        parse_policy("hedge:a->b@0s"),
        {"a": Arm("a", 5, valid=False), "b": Arm("b", 5)},
        max_live=1,
    )
    assert race.winner_attempt.provider == "b" and race.latency() == pytest.approx(10)


def test_adapter_confirmed_receipt_settles_the_cancel_and_outcome_is_json():
    from gpuhedge_celery.core.outcome import rates_from_mapping
    from gpuhedge_celery.core.rates import ProviderRate

    clock = VirtualClock()
    race = Race(parse_policy("hedge:a->b@0s"), clock, race_id="r9")
    race.start()
    race.handle(AttemptSubmitted("a1", "j1"))
    race.handle(AttemptSubmitted("a2", "j2"))
    clock.set(4.0)
    race.handle(ResultArrived("a1"))
    polled = CancelReceipt(provider="b", job_id="j2", was_running=True)
    polled.confirm_terminal(JobState.CANCELLED, 4300.0)  # the adapter polled it to terminal
    out = race.handle(CancelAcknowledged("a2", polled))
    assert out == [RaceFinished("a1", "")]
    receipt = race.attempt_for("hedge").receipt
    assert receipt.terminal_ms == 4300.0 and receipt.evidence is Evidence.CONFIRMED_TERMINAL
    rates = rates_from_mapping({"a": 0.001, "b": {"rate_per_s": 0.002, "idle_s": 10}})
    assert rates["b"] == ProviderRate(0.002, 10.0)
    outcome = race_outcome(race, rates).to_dict()
    text = json.dumps(outcome)
    assert json.loads(text)["winner_provider"] == "a"
    # the loser is priced to its end as polled (4.3 s), not to the cancel's decision (4 s)
    assert outcome["active_usd"] == pytest.approx(4 * 0.001 + 4.3 * 0.002)
    assert outcome["billed_usd"] == pytest.approx(outcome["active_usd"] + 10 * 0.002)
    assert outcome["wasted_usd"] == pytest.approx(4.3 * 0.002)
    assert [a["timeline"][0][1] for a in outcome["attempts"]] == ["launched", "launched"]
    assert len(outcome["receipts"]) == 1


@pytest.mark.parametrize("bad", [{"a": "cheap"}, {"a": {"idle_s": 3}}, {"a": -1.0}])
def test_bad_rates_are_config_errors(bad):
    from gpuhedge_celery.core.outcome import rates_from_mapping
    from gpuhedge_celery.errors import ConfigError

    with pytest.raises(ConfigError):
        rates_from_mapping(bad)


def test_a_submit_with_unknown_outcome_ends_as_a_flagged_leak_without_a_live_slot():
    from gpuhedge_celery.core.race_events import SubmitFailed

    clock = VirtualClock()
    race = Race(parse_policy("hedge:a->b@10s"), clock)
    race.start()
    clock.set(2.0)
    lost = SubmitFailed("a1", "provider 'a': submit outcome unknown: no reply", True)
    assert race.handle(event_from_dict(json.loads(json.dumps(lost.to_dict())))) == [
        Launch("a2", "b", "hedge")  # failed before the hedge time: the hedge goes at once
    ]
    a1 = race.attempt_for(PRIMARY)
    assert a1.receipt.leaked and a1.receipt.evidence is Evidence.NO_EVIDENCE
    assert "submit outcome unknown" in a1.receipt.note and "leaked" in race.flags
    race.handle(AttemptSubmitted("a2", "j2"))
    clock.set(3.0)
    assert kinds(race.handle(ResultArrived("a2"))) == ["declare_winner", "race_finished"]
    assert race.attempt_for(PRIMARY).receipt.leaked  # kept: not "ended on its own"
    # a plain refusal is no leak
    race = Race(parse_policy("single:a"), VirtualClock())
    race.start()
    race.handle(SubmitFailed("a1", "HTTP 400"))
    assert race.finished and not race.attempts[0].receipt.leaked and "leaked" not in race.flags


def test_a_refused_cancel_keeps_no_evidence_and_its_reason():
    from gpuhedge_celery.core.race_events import CancelFailed

    clock = VirtualClock()
    race = Race(parse_policy("hedge:a->b@0s"), clock)
    race.start()
    race.handle(AttemptSubmitted("a1", "j1"))
    race.handle(AttemptSubmitted("a2", "j2"))
    clock.set(5.0)
    race.handle(ResultArrived("a2"))
    refused = CancelReceipt(provider="a", job_id="j1", note="cancel: HTTP 401: bad token")
    assert refused.evidence is Evidence.NO_EVIDENCE  # the provider accepted nothing
    race.handle(CancelAcknowledged("a1", refused))
    race.handle(CancelFailed("a1", "the provider refused the cancel or never answered"))
    r = race.attempt_for(PRIMARY).receipt
    assert r.evidence is Evidence.NO_EVIDENCE and r.leaked and r.cancel_ack_ms is None
    assert r.note.startswith("cancel: HTTP 401: bad token") and "refused" in r.note
    labels = [label for _, label in race.attempt_for(PRIMARY).timeline]
    assert "cancel_refused" in labels and "cancel_acknowledged" not in labels
