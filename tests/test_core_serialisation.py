"""The core's explicit to_dict/from_dict code gives exactly what the dataclasses.asdict code gave.

``to_dict`` of the hot core types is written field by field for speed; these tests hold it to the
old ``asdict``-based output (reference helpers below), to independence from the object (asdict
deep-copied), and to lossless round trips, including whole races resumed from JSON mid-flight.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuhedge_celery.core._data import copy_data, enum_by_value, to_enum
from gpuhedge_celery.core.attempts import Attempt, Phase
from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.core.jobs import AttemptResult, JobHandle, JobState, LifecycleEvent
from gpuhedge_celery.core.lease_rules import GpuInfo, Lease, LeaseRow
from gpuhedge_celery.core.policies import (
    CascadePolicy,
    FixedHedgePolicy,
    SinglePolicy,
    StateAwarePolicy,
    parse_policy,
)
from gpuhedge_celery.core.race import Race
from gpuhedge_celery.core.race_events import (
    ACTION_TYPES,
    AttemptSubmitted,
    Cancel,
    CancelAcknowledged,
    CancelConfirmed,
    CancelFailed,
    DeclareWinner,
    GiveUp,
    Launch,
    PollStatus,
    RaceFinished,
    ResultArrived,
    ScheduleTimer,
    Start,
    StatusObserved,
    SubmitFailed,
    TimerDue,
    action_from_dict,
    event_from_dict,
)
from gpuhedge_celery.core.receipts import CancelReceipt, CancelScope, Evidence
from gpuhedge_celery.core.scripted import Arm, run_race

# --------------------------------------------------------------------------- reference (old) code


# Fields added after the asdict code are left out while they hold their default, so a worker of
# the previous release reads the rest (tests/test_wire_compat.py).
ADDED_AT_DEFAULT = {CancelReceipt: {"token_wait_ms": None}, ResultArrived: {"verified": True}}


def _without_added_defaults(obj: Any, data: dict[str, Any]) -> dict[str, Any]:
    for name, default in ADDED_AT_DEFAULT.get(type(obj), {}).items():
        if data.get(name, default) == default:
            data.pop(name, None)
    return data


def ref_receipt(r: CancelReceipt) -> dict[str, Any]:
    data = asdict(r)
    data["terminal_status"] = r.terminal_status.value if r.terminal_status else None
    data["evidence"] = r.evidence.value
    data["scope"] = r.scope.value
    return _without_added_defaults(r, data)


def ref_attempt(a: Attempt) -> dict[str, Any]:
    data = asdict(a)
    data["phase"] = a.phase.value
    data["receipt"] = ref_receipt(a.receipt) if a.receipt else None
    return data


def ref_event(e) -> dict[str, Any]:
    data: dict[str, Any] = {"kind": e.kind}
    for f in fields(e):
        value = getattr(e, f.name)
        if isinstance(value, JobState):
            value = value.value
        elif isinstance(value, CancelReceipt):
            value = ref_receipt(value)
        elif isinstance(value, tuple):
            value = list(value)
        data[f.name] = value
    return _without_added_defaults(e, data)


def ref_action(a) -> dict[str, Any]:
    return {"kind": a.kind, **asdict(a)}


def ref_race(race: Race) -> dict[str, Any]:
    return {
        "race_id": race.race_id,
        "policy": race.policy.to_dict(),
        "max_live": race.max_live,
        "started_at": race.started_at,
        "attempts": [ref_attempt(a) for a in race.attempts],
        "timers": dict(race.timers),
        "waiting": [list(w) for w in race.waiting],
        "state": dict(race.state),
        "flags": list(race.flags),
        "winner": race.winner,
        "finished": race.finished,
        "note": race.note,
    }


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (a str enum equals its value, a tuple
    does not equal a list: plain ``==`` alone would miss an enum left unconverted)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def json_trip(data: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(data))


# --------------------------------------------------------------------------- strategies

floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
opt_float = st.none() | floats
text = st.text(max_size=12)
json_scalar = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | floats | text
json_value = st.recursive(
    json_scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
json_object = st.dictionaries(text, json_value, max_size=4)

receipts = st.builds(
    CancelReceipt,
    provider=text,
    job_id=text,
    was_running=st.none() | st.booleans(),
    cancel_sent_ms=opt_float,
    cancel_ack_ms=opt_float,
    terminal_ms=opt_float,
    terminal_status=st.none() | st.sampled_from(JobState),
    execution_ms_before_cancel=opt_float,
    estimated_cost_usd=opt_float,
    reconciled_cost_usd=opt_float,
    evidence=st.sampled_from(Evidence),
    scope=st.sampled_from(CancelScope),
    confirmed_terminal=st.booleans(),
    billing_stop_confirmed=st.booleans(),
    leaked=st.booleans(),
    note=text,
)

attempts = st.builds(
    Attempt,
    id=text,
    provider=text,
    role=st.sampled_from(["primary", "hedge", "fallback"]),
    launched_at=floats,
    phase=st.sampled_from(Phase),
    submitted_at=opt_float,
    job_id=text,
    handle=st.none() | json_object,
    last_state=st.none() | st.sampled_from([s.value for s in JobState]),
    result_state=st.none() | st.sampled_from([s.value for s in JobState]),
    valid=st.none() | st.booleans(),
    reasons=st.lists(text, max_size=3),
    result_at=opt_float,
    cancel_reason=st.none() | text,
    cancel_requested=st.booleans(),
    cancel_sent_at=opt_float,
    timeline=st.lists(st.lists(floats | text, min_size=2, max_size=2), max_size=5),
    receipt=st.none() | receipts,
)

handles = st.builds(JobHandle, provider=text, job_id=text, submitted_at=floats, extra=json_object)
lifecycle = st.builds(LifecycleEvent, t_ms=floats, stage=text, detail=text)
labels = st.dictionaries(text, text, max_size=3)
gpus = st.builds(GpuInfo, gpu_id=text, pool=text, host=text, labels=labels)
ints = st.integers(0, 2**53)
leases = st.builds(
    Lease, gpu_id=text, pool=text, token=ints, holder=text, ttl_ms=ints, since_ms=ints
)
lease_rows = st.builds(
    LeaseRow,
    gpu_id=text,
    pool=text,
    host=text,
    host_live=st.booleans(),
    state=st.sampled_from(["free", "held", "stale"]),
    holder=st.none() | text,
    token=st.none() | ints,
    ttl_left_ms=st.none() | ints,
    since_ms=st.none() | ints,
    accepted_token=ints,
    labels=labels,
)

events = st.one_of(
    st.just(Start()),
    st.builds(TimerDue, key=text),
    st.builds(AttemptSubmitted, attempt_id=text, job_id=text, handle=st.none() | json_object),
    st.builds(SubmitFailed, attempt_id=text, error=text),
    st.builds(
        StatusObserved,
        attempt_id=text,
        state=st.none() | st.sampled_from(JobState),
        error=st.none() | text,
    ),
    st.builds(
        ResultArrived,
        attempt_id=text,
        state=st.sampled_from(JobState),
        valid=st.booleans(),
        reasons=st.lists(text, max_size=3).map(tuple),
    ),
    st.builds(CancelAcknowledged, attempt_id=text, receipt=st.none() | receipts),
    st.builds(CancelConfirmed, attempt_id=text, state=st.sampled_from(JobState)),
    st.builds(CancelFailed, attempt_id=text, error=text),
)

actions = st.one_of(
    st.builds(Launch, attempt_id=text, provider=text, role=text),
    st.builds(PollStatus, attempt_id=text),
    st.builds(Cancel, attempt_id=text, reason=text),
    st.builds(ScheduleTimer, key=text, at=floats),
    st.builds(DeclareWinner, attempt_id=text),
    st.builds(RaceFinished, winner=st.none() | text, note=text),
)

EXAMPLES = settings(max_examples=200, deadline=None)

# --------------------------------------------------------------------------- representative values


def full_receipt() -> CancelReceipt:
    r = CancelReceipt(
        "runpod",
        "job-1",
        was_running=True,
        cancel_sent_ms=29_000.0,
        cancel_ack_ms=29_300.0,
        execution_ms_before_cancel=28_800.0,
        estimated_cost_usd=0.0123,
        evidence=Evidence.PROVIDER_ACK,
        scope=CancelScope.REQUEST,
        note="cancel sent",
    )
    r.confirm_terminal(JobState.CANCELLED, 29_400.0)
    return r


def full_attempt() -> Attempt:
    return Attempt(
        id="a1",
        provider="runpod",
        role="primary",
        launched_at=0.0,
        phase=Phase.CANCELLED,
        submitted_at=0.2,
        job_id="job-1",
        handle={"provider": "runpod", "job_id": "job-1", "extra": {"ep": "e1", "n": [1, 2]}},
        last_state="CANCELLED",
        result_state=None,
        valid=None,
        reasons=["slow"],
        cancel_reason="lost",
        cancel_requested=True,
        cancel_sent_at=29.0,
        timeline=[[0.0, "launched"], [0.2, "submitted"], [29.0, "cancel_sent (lost)"]],
        receipt=full_receipt(),
    )


def test_representative_values_match_the_asdict_output():
    a = full_attempt()
    assert same(a.to_dict(), ref_attempt(a))
    fresh = Attempt("a2", "cerebrium", "hedge", 10.2)
    assert same(fresh.to_dict(), ref_attempt(fresh))
    assert fresh.to_dict()["phase"] == "launching" and type(fresh.to_dict()["phase"]) is str
    r = full_receipt()
    assert same(r.to_dict(), ref_receipt(r))
    assert r.to_dict()["terminal_status"] == "CANCELLED" and r.to_dict()["evidence"] == (
        "confirmed_terminal"
    )
    h = JobHandle("modal", "fc-1", 1_700_000_000.5, {"call": {"id": "x", "tags": ["a"]}})
    assert same(h.to_dict(), asdict(h))
    ev = LifecycleEvent(12.5, "queued", "pos 3")
    assert same(ev.to_dict(), asdict(ev))
    gpu = GpuInfo("g0", "pool", "host-1", {"sku": "h100"})
    assert same(gpu.to_dict(), asdict(gpu))
    lease = Lease("g0", "pool", 7, "worker@1", 60_000, 123)
    assert same(lease.to_dict(), asdict(lease))
    row = LeaseRow("g0", "pool", "host-1", True, "held", "w", 7, 500, 1, 7, {"sku": "h100"})
    # plus the one derived field the lease table shows (in pool / draining / drained / out)
    assert same(row.to_dict(), {**asdict(row), "availability": row.availability})
    assert row.availability == "in pool"


def test_every_action_and_event_type_matches_the_reference_code():
    evs = [
        Start(),
        TimerDue("hedge"),
        AttemptSubmitted("a1", "job-1", {"provider": "p", "extra": {"k": [1]}}),
        SubmitFailed("a1", "boom"),
        StatusObserved("a1", JobState.QUEUED),
        StatusObserved("a1", None, "poll failed"),
        ResultArrived("a1", JobState.COMPLETED, True, ("ok", "fast")),
        CancelAcknowledged("a1", full_receipt()),
        CancelAcknowledged("a1"),
        CancelConfirmed("a1"),
        CancelFailed("a1", "raised"),
    ]
    for e in evs:
        assert same(e.to_dict(), ref_event(e)), e
        assert event_from_dict(e.to_dict()) == e
        assert event_from_dict(json_trip(e.to_dict())) == e
    acts = [
        Launch("a1", "runpod", "primary"),
        PollStatus("a1"),
        Cancel("a1", "lost"),
        ScheduleTimer("hedge", 10.2),
        DeclareWinner("a2"),
        GiveUp("no valid result within the race's deadline (60 s)"),
        RaceFinished(None, "no attempt returned a valid result"),
    ]
    assert {type(a) for a in acts} == set(ACTION_TYPES.values())
    for a in acts:
        assert same(a.to_dict(), ref_action(a)), a
        assert action_from_dict(json_trip(a.to_dict())) == a


def test_to_dict_output_shares_no_container_with_the_object():
    """asdict deep-copied: mutating the dict (or the object) must not reach the other."""
    a = full_attempt()
    before = ref_attempt(a)
    d = a.to_dict()
    d["handle"]["extra"]["n"].append(3)
    d["reasons"].append("x")
    d["timeline"][0][1] = "changed"
    d["timeline"].append([1.0, "x"])
    d["receipt"]["note"] = "changed"
    assert same(ref_attempt(a), before)
    h = JobHandle("p", "j", 1.0, {"deep": {"list": [1]}})
    hd = h.to_dict()
    hd["extra"]["deep"]["list"].append(2)
    assert h.extra == {"deep": {"list": [1]}}
    gpu = GpuInfo("g", "p", "h", {"a": "b"})
    gpu.to_dict()["labels"]["a"] = "c"
    assert gpu.labels == {"a": "b"}
    row = LeaseRow("g", "p", "h", True, "free", None, None, None, None, 0, {"a": "b"})
    row.to_dict()["labels"]["a"] = "c"
    assert row.labels == {"a": "b"}


@dataclass
class _Holder:
    value: Any


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize(
    "value",
    [
        None,
        1,
        1.5,
        "s",
        True,
        JobState.QUEUED,
        Phase.RUNNING,
        [1, [2, {"a": (3, 4)}]],
        (1, [2]),
        {"k": {"n": [1, 2]}, 3: "int key"},
        Point(1, [2]),
        collections.OrderedDict([("a", 1)]),
        {1, 2},
        _Holder([1, {"a": 2}]),
    ],
    ids=repr,
)
def test_copy_data_is_what_asdict_makes_of_a_field(value):
    expected = asdict(_Holder(value))["value"]
    got = copy_data(value)
    assert same(got, expected)
    if isinstance(value, (list, dict)) and value:
        assert got is not value


@pytest.mark.parametrize("cls", [Phase, JobState, Evidence, CancelScope])
def test_to_enum_agrees_with_the_enum_call(cls):
    table = enum_by_value(cls)
    for member in cls:
        assert to_enum(cls, table, member.value) is member
        assert to_enum(cls, table, member) is member
    for bad in ("nope", None, ["unhashable"]):
        with pytest.raises(ValueError):
            cls(bad)
        with pytest.raises(ValueError):
            to_enum(cls, table, bad)


# --------------------------------------------------------------------------- generated instances


@EXAMPLES
@given(attempts)
def test_attempt_to_dict_matches_asdict_and_round_trips(a):
    assert same(a.to_dict(), ref_attempt(a))
    assert Attempt.from_dict(a.to_dict()) == a
    back = Attempt.from_dict(json_trip(a.to_dict()))
    assert back == a
    assert back.phase is a.phase


@EXAMPLES
@given(receipts)
def test_receipt_to_dict_matches_asdict_and_round_trips(r):
    assert same(r.to_dict(), ref_receipt(r))
    back = CancelReceipt.from_dict(json_trip(r.to_dict()))
    assert back == r
    assert back.evidence is r.evidence and back.scope is r.scope
    assert back.terminal_status is r.terminal_status


@EXAMPLES
@given(handles, lifecycle)
def test_job_types_match_asdict_and_round_trip(h, ev):
    assert same(h.to_dict(), asdict(h))
    assert JobHandle.from_dict(json_trip(h.to_dict())) == h
    assert JobHandle.from_json(h.to_json()) == h
    assert same(ev.to_dict(), asdict(ev))
    result = AttemptResult(h.provider, h.job_id, JobState.COMPLETED, 12.5, {"x": 1}, {}, [ev])
    assert AttemptResult.from_dict(json_trip(result.to_dict())) == result


@EXAMPLES
@given(gpus, leases, lease_rows)
def test_lease_types_match_asdict_and_round_trip(gpu, lease, row):
    assert same(gpu.to_dict(), asdict(gpu))
    assert same(lease.to_dict(), asdict(lease))
    assert same(row.to_dict(), {**asdict(row), "availability": row.availability})
    assert GpuInfo.from_dict(json_trip(gpu.to_dict())) == gpu
    assert Lease.from_dict(json_trip(lease.to_dict())) == lease


@EXAMPLES
@given(events, actions)
def test_events_and_actions_match_the_reference_and_round_trip(e, a):
    assert same(e.to_dict(), ref_event(e))
    assert event_from_dict(json_trip(e.to_dict())) == e
    assert same(a.to_dict(), ref_action(a))
    assert action_from_dict(json_trip(a.to_dict())) == a


# --------------------------------------------------------------------------- whole races


def _check_race_state(race: Race) -> None:
    saved = race.to_dict()
    assert same(saved, ref_race(race))
    resumed = Race.from_dict(json_trip(saved), VirtualClock(race.clock.now()))
    assert same(resumed.to_dict(), json_trip(saved))
    assert len(resumed.attempts) == len(race.attempts)
    for a, b in zip(race.attempts, resumed.attempts, strict=True):
        assert a == b


def _hedged_race_events():
    """A two-attempt hedged race: primary slow, hedge wins, primary's cancel confirmed."""
    h1 = JobHandle("runpod", "job-1", 1_700_000_000.2, {"endpoint": "ep-1", "region": "eu"})
    h2 = JobHandle("cerebrium", "job-2", 1_700_000_010.3, {"app": "x", "run": ["r", 9]})
    receipt = CancelReceipt("runpod", "job-1", was_running=True, evidence=Evidence.PROVIDER_ACK)
    return [
        (0.2, AttemptSubmitted("a1", "job-1", h1.to_dict())),
        (5.0, StatusObserved("a1", JobState.IN_PROGRESS)),
        (10.2, TimerDue("hedge")),
        (10.3, AttemptSubmitted("a2", "job-2", h2.to_dict())),
        (29.0, ResultArrived("a2", JobState.COMPLETED, True, ())),
        (29.3, CancelAcknowledged("a1", receipt)),
        (29.4, CancelConfirmed("a1", JobState.CANCELLED)),
    ]


def test_hedged_race_resumed_from_json_after_every_event_runs_identically():
    policy = "hedge:runpod->cerebrium@10s"
    clock = VirtualClock()
    straight = Race(parse_policy(policy), clock, race_id="r1")
    straight_actions = [a.to_dict() for a in straight.start()]
    for t, event in _hedged_race_events():
        clock.set(t)
        straight_actions += [a.to_dict() for a in straight.handle(event)]
        _check_race_state(straight)
    assert straight.finished and straight.winner == "a2"

    # the same race, saved to JSON and rebuilt (as a worker does) before every event
    clock2 = VirtualClock()
    race = Race(parse_policy(policy), clock2, race_id="r1")
    resumed_actions = [a.to_dict() for a in race.start()]
    for t, event in _hedged_race_events():
        race = Race.from_dict(json.loads(json.dumps(race.to_dict())), clock2)
        clock2.set(t)
        wire = event_from_dict(json.loads(json.dumps(event.to_dict())))
        resumed_actions += [json_trip(a.to_dict()) for a in race.handle(wire)]
    assert resumed_actions == json_trip({"a": straight_actions})["a"]
    assert same(json_trip(race.to_dict()), json_trip(straight.to_dict()))
    receipt = race.attempt_for("primary").receipt
    assert receipt.evidence is Evidence.CONFIRMED_TERMINAL and not receipt.leaked


seconds = st.floats(min_value=0.0, max_value=60.0, allow_nan=False).map(lambda x: round(x, 1))


@st.composite
def arm(draw, name: str) -> Arm:
    ack = draw(st.sampled_from([0.0, 0.3]))
    return Arm(
        provider=name,
        wall_s=draw(seconds),
        valid=draw(st.booleans()),
        state=draw(st.sampled_from([JobState.COMPLETED, JobState.FAILED])),
        reasons=draw(st.sampled_from([(), ("bad output",)])),
        submitted=draw(st.sampled_from([True] * 5 + [False])),
        queue_delay_s=draw(st.none() | st.just(3.0)),
        poll_error=draw(st.booleans()),
        cancel_ack_s=ack,
        cancel_terminal_s=draw(st.sampled_from([ack, ack + 5.0, None])),
        cancel_raises=draw(st.sampled_from([False] * 3 + [True])),
    )


policies = st.sampled_from(
    [
        SinglePolicy("p"),
        FixedHedgePolicy("p", "h", 0),
        FixedHedgePolicy("p", "h", 4_000),
        StateAwarePolicy("p", "h", 2_500, 8_500),
        CascadePolicy("p", "h", "f", 2_500, 8_500, 20_000),
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=policies, p=arm("p"), h=arm("h"), f=arm("f"))
def test_every_state_of_generated_races_matches_the_reference_and_round_trips(policy, p, h, f):
    race = run_race(policy, {"p": p, "h": h, "f": f}, race_id="gen", after_event=_check_race_state)
    _check_race_state(race)


def test_reference_helpers_can_tell_a_difference():
    """The comparisons above would catch a wrong field, an unconverted enum or a tuple."""
    a = full_attempt()
    d = a.to_dict()
    assert not same({**d, "phase": Phase.CANCELLED}, ref_attempt(a))  # enum, not its value
    assert not same({**d, "reasons": tuple(a.reasons)}, ref_attempt(a))
    missing = dict(d)
    missing.pop("cancel_sent_at")
    assert not same(missing, ref_attempt(a))
    assert {f.name for f in dataclasses.fields(Attempt)} == set(d)
