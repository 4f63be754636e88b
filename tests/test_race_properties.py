"""Property tests: the race engine's guarantees over random provider timelines and policies."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuhedge_celery.core.jobs import JobState
from gpuhedge_celery.core.policies import (
    CascadePolicy,
    FixedHedgePolicy,
    SinglePolicy,
    StateAwarePolicy,
)
from gpuhedge_celery.core.race_events import Cancel, DeclareWinner
from gpuhedge_celery.core.scripted import Arm, run_race

seconds = st.floats(min_value=0.0, max_value=150.0, allow_nan=False).map(lambda x: round(x, 1))


@st.composite
def arm(draw, name: str) -> Arm:
    wall = draw(seconds)
    ack = draw(st.sampled_from([0.0, 0.3, 2.0]))
    return Arm(
        provider=name,
        wall_s=wall,
        valid=draw(st.booleans() | st.just(True)),
        state=draw(st.sampled_from([JobState.COMPLETED] * 4 + [JobState.FAILED])),
        submitted=draw(st.sampled_from([True] * 9 + [False])),
        queue_delay_s=draw(st.none() | st.floats(0.0, 40.0).map(lambda x: round(x, 1))),
        poll_error=draw(st.sampled_from([False] * 4 + [True])),
        cancel_ack_s=ack,
        cancel_terminal_s=draw(st.sampled_from([ack, ack + 0.1, ack + 20.0, None])),
        cancel_raises=draw(st.sampled_from([False] * 5 + [True])),
    )


ms = st.integers(min_value=0, max_value=60_000).map(lambda x: x - x % 100)


@st.composite
def policy(draw):
    kind = draw(st.sampled_from(["single", "fixed", "state_aware", "cascade"]))
    if kind == "single":
        return SinglePolicy("p")
    if kind == "fixed":
        return FixedHedgePolicy("p", "h", draw(ms))
    q = draw(ms)
    s = q + draw(ms)
    if kind == "state_aware":
        return StateAwarePolicy("p", "h", q, s)
    return CascadePolicy("p", "h", "f", q, s, draw(ms))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=policy(),
    p=arm("p"),
    h=arm("h"),
    f=arm("f"),
    cap=st.none() | st.sampled_from([30.0, 90.0]),
)
def test_race_invariants(policy, p, h, f, cap):
    trace: list = []
    live: list[int] = []
    race = run_race(
        policy,
        {"p": p, "h": h, "f": f},
        cap_s=cap,
        trace=trace,
        after_event=lambda r: live.append(r.live_count),
    )
    assert race.finished
    # never more than two live jobs at any moment
    assert max(live, default=0) <= 2
    # exactly one winner whenever a valid result arrived, and it is the first valid one
    valid = [a for a in race.attempts if a.valid]
    declared = [a for _, a in trace if isinstance(a, DeclareWinner)]
    if valid:
        assert len(declared) == 1 and race.winner == declared[0].attempt_id
        assert race.winner_attempt.result_at == min(a.result_at for a in valid)
    else:
        assert declared == [] and race.winner is None and race.latency() is None
    # every launched loser has a receipt; no job is cancelled twice
    for attempt in race.attempts:
        if attempt.id != race.winner:
            assert attempt.receipt is not None
    cancels = [a.attempt_id for _, a in trace if isinstance(a, Cancel)]
    assert len(cancels) == len(set(cancels))
    # a leaked receipt never loses a won race; the flag matches the receipts
    leaked = [a for a in race.attempts if a.receipt is not None and a.receipt.leaked]
    if leaked:
        assert "leaked" in race.flags
    # the fallback is launched at most once, and only by a cascade
    fallbacks = [a for a in race.attempts if a.role == "fallback"]
    assert len(fallbacks) <= (1 if isinstance(policy, CascadePolicy) else 0)


@settings(max_examples=300, deadline=None)
@given(
    p=arm("p"),
    h=arm("h"),
    after=ms,
    cap=st.none() | st.sampled_from([30.0, 90.0]),
)
def test_fixed_hedge_never_slower_than_the_primary_alone(p, h, after, cap):
    race = run_race(FixedHedgePolicy("p", "h", after), {"p": p, "h": h}, cap_s=cap)
    primary_alone = run_race(SinglePolicy("p"), {"p": p}, cap_s=cap)
    if primary_alone.latency() is not None:
        assert race.latency() is not None
        assert race.latency() <= primary_alone.latency() + 1e-9


@pytest.mark.parametrize("after_ms", [0, 5_000, 10_000])
def test_fixed_property_holds_on_a_slow_primary_with_broken_cancel(after_ms):
    p = Arm("p", 100.0, cancel_raises=True)
    h = Arm("h", 30.0, cancel_terminal_s=None)
    race = run_race(FixedHedgePolicy("p", "h", after_ms), {"p": p, "h": h})
    assert race.latency() == pytest.approx(after_ms / 1000 + 30.0)
    assert race.attempt_for("primary").receipt.leaked
