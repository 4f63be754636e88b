"""The sim adapter: seeded draws, clock-driven transitions, cancels, rebuilding in any process."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from gpuhedge_celery.config import parse_config
from gpuhedge_celery.core.clock import VirtualClock, WallClock
from gpuhedge_celery.core.jobs import JobHandle, JobState
from gpuhedge_celery.core.receipts import CancelScope, Evidence
from gpuhedge_celery.core.validators import validate
from gpuhedge_celery.errors import ConfigError, SubmitError
from gpuhedge_celery.providers import build_provider
from gpuhedge_celery.providers.sim import MemoryLedger, RedisLedger, SimProvider, SimSpec
from gpuhedge_celery.providers.simspec import Dist, SimMode

FIXED = SimSpec(
    fast=SimMode(Dist("constant", 2.0, 2.0), Dist("constant", 4.0, 4.0)),
    slow=SimMode(Dist("constant", 20.0, 20.0), Dist("constant", 90.0, 90.0)),
)


def sim(spec: SimSpec = FIXED, clock: VirtualClock | None = None, **kw) -> SimProvider:
    clock = clock or VirtualClock(1_000.0)
    return SimProvider("sim-a", spec, clock=clock, ledger=kw.pop("ledger", MemoryLedger()), **kw)


def test_draws_are_deterministic_per_seed_and_key():
    spec = SimSpec(seed=42, slow_probability=0.5, invalid_probability=0.2)
    a, b = sim(spec), sim(spec)
    draws_a = [a.submit({"sim_key": k}).extra["sim"] for k in range(20)]
    draws_b = [b.submit({"sim_key": k}).extra["sim"] for k in range(20)]
    assert draws_a == draws_b
    assert {d["slow"] for d in draws_a} == {True, False}  # bimodal: both modes show up
    other = sim(SimSpec(seed=43, slow_probability=0.5))
    assert [other.submit({"sim_key": k}).extra["sim"] for k in range(20)] != draws_a
    # without sim_key the provider numbers its submissions through the ledger: 0, 1, 2...
    counted = sim(spec)
    assert [counted.submit({}).extra["sim"] for _ in range(3)] == draws_a[:3]


def test_mode_draws_respect_their_ranges():
    spec = SimSpec(seed=1, slow_probability=0.3)  # defaults: fast 1.1-2.0 / 3.8-5.0 s
    p = sim(spec)
    for k in range(200):
        d = p.submit({"sim_key": k}).extra["sim"]
        lo, hi = (9.0, 27.0) if d["slow"] else (1.1, 2.0)
        assert lo <= d["queue_s"] <= hi


def test_transitions_follow_the_clock_and_result_is_exact():
    clock = VirtualClock(1_000.0)
    p = sim(clock=clock)
    h = p.submit({"sim": {"sim-a": {"queue_s": 2.0, "run_s": 4.0}}})
    assert p.status(h) is JobState.QUEUED
    clock.advance(1.99)
    assert p.status(h) is JobState.QUEUED
    clock.advance(0.02)
    assert p.status(h) is JobState.IN_PROGRESS
    assert p.next_change_at(h) == pytest.approx(1_006.0)
    r = p.result(h, cap_s=60)
    assert r.state is JobState.COMPLETED
    assert r.wall_ms == pytest.approx(6_000.0)
    assert clock.now() == pytest.approx(1_006.0, abs=0.06)  # slept to the end, not to the cap
    assert [e.stage for e in r.events] == ["queued", "running", "completed"]
    assert r.metrics["delay_ms"] == pytest.approx(2_000.0)
    assert r.metrics["execution_ms"] == pytest.approx(4_000.0)
    assert validate("wav", r.payload).ok


def test_already_terminal_result_returns_without_sleeping():
    clock = VirtualClock(0.0)
    slept: list[float] = []
    p = sim(clock=clock, sleep=slept.append)
    h = p.submit({"sim": {"sim-a": {"queue_s": 1, "run_s": 1}}})
    clock.advance(5.0)
    assert p.result(h, cap_s=60).state is JobState.COMPLETED
    assert slept == []


def test_time_scale_compresses_wall_time_but_not_costs():
    clock = VirtualClock(0.0)
    spec = SimSpec(time_scale=0.01, fast=FIXED.fast)
    p = sim(spec, clock=clock, billed_rate_per_s=0.001)
    h = p.submit({})
    r = p.result(h, cap_s=1.0)
    assert r.state is JobState.COMPLETED
    assert r.wall_ms == pytest.approx(60.0)  # 6 provider-seconds in 0.06 real seconds
    assert r.metrics["execution_ms"] == pytest.approx(4_000.0)
    assert r.metrics["cost_usd"] == pytest.approx(0.004)


def test_cap_right_censors_to_timeout():
    clock = VirtualClock(0.0)
    p = sim(clock=clock)
    h = p.submit({"sim": {"sim-a": {"slow": True, "queue_s": 20, "run_s": 90}}})
    r = p.result(h, cap_s=30.0)
    assert r.state is JobState.TIMEOUT
    assert r.wall_ms == 30_000.0
    assert clock.now() == pytest.approx(30.0)
    assert r.events[-1].stage == "timeout"
    assert p.status(h) is JobState.IN_PROGRESS  # the job itself is untouched


@pytest.mark.parametrize(
    "outcome,state,valid",
    [
        ("ok", "COMPLETED", True),
        ("invalid", "COMPLETED", False),
        ("failed", "FAILED", False),
    ],  # fmt: skip
)
def test_outcomes(outcome, state, valid):
    p = sim()
    r = p.result(p.submit({"sim": {"sim-a": {"outcome": outcome}}}), cap_s=60)
    assert r.state.value == state
    assert validate("wav", r.payload).ok is valid
    if outcome == "invalid":
        assert "near-silent" in validate("wav", r.payload).reasons[0]


def test_invalid_probability_draws_invalid_results():
    p = sim(SimSpec(seed=5, invalid_probability=0.5))
    outcomes = {p.submit({"sim_key": k}).extra["sim"]["outcome"] for k in range(30)}
    assert outcomes == {"ok", "invalid"}


def test_submit_errors():
    p = sim()
    with pytest.raises(SubmitError, match="simulated submit failure"):
        p.submit({"sim": {"sim-a": {"outcome": "submit_error"}}})
    with pytest.raises(SubmitError, match="unknown sim override 'speed'"):
        p.submit({"sim": {"sim-a": {"speed": 1}}})
    with pytest.raises(SubmitError, match="must be a dict"):
        p.submit("text")  # type: ignore[arg-type]


def test_cancel_while_queued_costs_nothing_and_is_confirmed():
    clock = VirtualClock(0.0)
    p = sim(clock=clock, billed_rate_per_s=0.001)
    h = p.submit({"sim": {"sim-a": {"queue_s": 20, "run_s": 90}}})
    clock.advance(2.5)
    receipt = p.cancel(h)
    assert receipt.evidence is Evidence.CONFIRMED_TERMINAL and not receipt.leaked
    assert receipt.terminal_status is JobState.CANCELLED
    assert receipt.scope is CancelScope.QUEUED_JOB and receipt.was_running is False
    assert receipt.execution_ms_before_cancel == 0.0 and receipt.reconciled_cost_usd == 0.0
    assert receipt.cancel_sent_ms < receipt.cancel_ack_ms <= receipt.terminal_ms
    assert receipt.terminal_ms - receipt.cancel_sent_ms == pytest.approx(350.0)
    clock.advance(30)  # it never starts afterwards
    assert p.status(h) is JobState.CANCELLED
    r = p.result(h, cap_s=200)
    assert r.state is JobState.CANCELLED and r.payload is None


def test_cancel_while_running_bills_until_terminal():
    clock = VirtualClock(0.0)
    p = sim(clock=clock, billed_rate_per_s=0.001)
    h = p.submit({"sim": {"sim-a": {"queue_s": 2, "run_s": 90}}})
    clock.advance(12.0)
    receipt = p.cancel(h)
    assert receipt.scope is CancelScope.REQUEST and receipt.was_running is True
    assert receipt.execution_ms_before_cancel == pytest.approx(10_350.0)
    assert receipt.reconciled_cost_usd == pytest.approx(0.01035)
    assert receipt.billing_stop_confirmed and receipt.confirmed_terminal


def test_cancel_after_completion_and_completion_racing_the_cancel():
    clock = VirtualClock(0.0)
    p = sim(clock=clock, billed_rate_per_s=0.001)
    done = p.submit({"sim": {"sim-a": {"queue_s": 1, "run_s": 1}}})
    clock.advance(3)
    receipt = p.cancel(done)
    assert receipt.terminal_status is JobState.COMPLETED and "already COMPLETED" in receipt.note
    racing = p.submit({"sim": {"sim-a": {"queue_s": 1, "run_s": 1}}})
    clock.advance(1.9)  # ends at 2.0 s, before the cancel's 0.35 s takes effect
    receipt = p.cancel(racing)
    assert receipt.terminal_status is JobState.COMPLETED
    assert "before the cancel took effect" in receipt.note
    assert p.result(racing, cap_s=10).state is JobState.COMPLETED


@pytest.mark.parametrize("redis_ledger_on", [False, True])
def test_many_polls_at_once_read_as_each_one_alone(redis_ledger_on, request):
    # queued, running, done, cancelled while running, cancelled while queued: one ledger read
    ledger = MemoryLedger()
    if redis_ledger_on:
        ledger = redis_ledger(request.getfixturevalue("redis_url"),
                              request.getfixturevalue("prefix"))  # fmt: skip
    clock = VirtualClock(0.0)
    p = sim(clock=clock, ledger=ledger)
    fates = [(10, 90), (1, 90), (1, 1), (1, 90), (20, 90)]
    handles = [p.submit({"sim": {"sim-a": {"queue_s": q, "run_s": r}}}) for q, r in fates]
    clock.advance(3)
    p.cancel(handles[3])
    p.cancel(handles[4])
    clock.advance(1)
    many = p.status_and_next_change_many(handles)
    assert many == [p.status_and_next_change(h) for h in handles]
    assert [state for state, _ in many] == [
        JobState.QUEUED, JobState.IN_PROGRESS, JobState.COMPLETED, JobState.CANCELLED,
        JobState.CANCELLED,
    ]  # fmt: skip
    assert many[0][1] == pytest.approx(10.0) and many[2][1] is None
    assert p.status_and_next_change_many([]) == []


def test_cancel_is_idempotent_across_provider_instances():
    clock, ledger = VirtualClock(0.0), MemoryLedger()
    a = sim(clock=clock, ledger=ledger)
    b = sim(clock=clock, ledger=ledger)
    h = a.submit({"sim": {"sim-a": {"queue_s": 5, "run_s": 5}}})
    clock.advance(1)
    first = a.cancel(h)
    second = b.cancel(JobHandle.from_json(h.to_json()))
    assert first.terminal_ms == second.terminal_ms  # the first cancel's record is reused


def test_an_audit_allows_for_the_canceller_reading_another_clock():
    """The canceller's clock (Redis's, read through a round trip) may run a little ahead of
    the auditor's: a cancel it confirmed 0.1 s "from now" is not a running job, a job queued
    for seconds still is."""
    from gpuhedge_celery.providers.redis_ledger import sim_job_running

    ledger = MemoryLedger()
    canceller = sim(clock=VirtualClock(100.1), ledger=ledger)
    auditor = sim(clock=VirtualClock(100.0), ledger=ledger)  # 0.1 s behind the canceller
    spec = {
        "sim": {"sim-a": {"queue_s": 30, "run_s": 5, "cancel_ack_s": 0, "cancel_terminal_s": 0}}
    }
    h = auditor.submit(spec)
    assert canceller.cancel(h).terminal_status is JobState.CANCELLED
    assert auditor.status(h) is JobState.QUEUED  # on the auditor's own clock, not yet
    assert not sim_job_running(auditor, h)
    assert sim_job_running(auditor, auditor.submit(spec))  # never cancelled: queued for 30 s
    assert sim_job_running(auditor, h, slack_s=0.0)


def test_coarse_provider_reports_in_progress_while_queued():
    clock = VirtualClock(0.0)
    p = sim(SimSpec(reports_queue_state=False, fast=FIXED.fast), clock=clock)
    h = p.submit({})
    assert p.reports_queue_state is False
    assert p.status(h) is JobState.IN_PROGRESS
    clock.advance(1)
    receipt = p.cancel(h)
    assert receipt.was_running is None and receipt.reconciled_cost_usd == 0.0


def test_timeline_lists_natural_transitions():
    p = sim(clock=VirtualClock(100.0))
    h = p.submit({"sim": {"sim-a": {"queue_s": 2, "run_s": 3, "outcome": "failed"}}})
    assert p.timeline(h) == [(100.0, JobState.QUEUED), (102.0, JobState.IN_PROGRESS),
                             (105.0, JobState.FAILED)]  # fmt: skip


def test_lognormal_distribution_is_parsed_and_centred():
    cfg = parse_config(
        {"providers": {"p": {"adapter": "sim", "sim": {
            "seed": 3, "fast": {"run_s": {"lognormal": {"median": 10, "sigma": 0.2}}}}}}}
    )  # fmt: skip
    p = build_provider("p", cfg.provider("p"), clock=VirtualClock(0.0), ledger=MemoryLedger())
    runs = sorted(p.submit({"sim_key": k}).extra["sim"]["run_s"] for k in range(201))
    assert 9.0 < runs[100] < 11.0 and runs[0] > 3.0


@pytest.mark.parametrize(
    "block,key,fragment",
    [
        ({"seed": "x"}, "providers.p.sim.seed", "expected an integer"),
        ({"time_scale": 0}, "providers.p.sim.time_scale", "expected a number > 0"),
        ({"fast": {"queue_s": [3, 1]}}, "providers.p.sim.fast.queue_s", "low <= high"),
        ({"slow_probability": 1.5}, "providers.p.sim.slow_probability", "<= 1"),
        ({"cancel": {"ack_s": 1, "terminal_s": 0.5}}, "providers.p.sim.cancel.ack_s", "ack_s"),
        ({"sed": 1}, "providers.p.sim.sed", "did you mean 'seed'"),
    ],
)
def test_sim_block_errors_name_the_key(block, key, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config({"providers": {"p": {"adapter": "sim", "sim": block}}}, source="x.yaml")
    message = str(info.value)
    assert message.startswith(f"x.yaml: {key}: ") and fragment in message and "\n" not in message


def redis_ledger(url: str, prefix: str) -> RedisLedger:
    import redis

    return RedisLedger(redis.Redis.from_url(url, decode_responses=True), prefix)


CHILD = r"""
import json, sys
from gpuhedge_celery.config import parse_config
from gpuhedge_celery.core.jobs import JobHandle
from tests.test_sim import redis_ledger
cfg, handle, url, prefix = json.loads(sys.argv[1])
ledger = redis_ledger(url, prefix)
provider = parse_config(cfg).build("p", ledger=ledger)
h = JobHandle.from_json(handle)
first = provider.status(h).value
result = provider.result(h, cap_s=5.0)
print(json.dumps({"first": first, "state": result.state.value, "wall_ms": result.wall_ms}))
"""


def test_another_process_rebuilds_the_job_from_handle_json_and_sees_the_cancel(redis_url, prefix):
    cfg = {"providers": {"p": {"adapter": "sim", "sim": {"time_scale": 0.01}}}}
    ledger = redis_ledger(redis_url, prefix)
    parent = parse_config(cfg).build("p", clock=WallClock(), ledger=ledger)
    h = parent.submit({"sim": {"p": {"queue_s": 100, "run_s": 100}}})  # 2 s of real time
    args = json.dumps([cfg, h.to_json(), redis_url, prefix])
    child = subprocess.Popen([sys.executable, "-c", CHILD, args], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    receipt = parent.cancel(h)
    out, _ = child.communicate(timeout=60)
    seen = json.loads(out)
    assert seen["state"] == "CANCELLED"  # the child learnt of the cancel through the ledger
    assert receipt.terminal_status is JobState.CANCELLED and receipt.reconciled_cost_usd == 0.0
    assert seen["wall_ms"] == pytest.approx(receipt.terminal_ms - h.submitted_at * 1000, abs=1)

    # and an untouched job reads the same in both processes
    h2 = parent.submit({"sim": {"p": {"queue_s": 10, "run_s": 20}}})
    args = json.dumps([cfg, h2.to_json(), redis_url, prefix])
    out = subprocess.run([sys.executable, "-c", CHILD, args], capture_output=True, text=True,
                         timeout=60, check=True).stdout  # fmt: skip
    seen = json.loads(out)
    assert seen["state"] == "COMPLETED" and seen["wall_ms"] == pytest.approx(300.0)
    assert parent.result(h2, cap_s=5.0).wall_ms == seen["wall_ms"]


def test_per_job_slow_cancel_lets_the_job_finish_first():
    clock = VirtualClock(0.0)
    p = sim(clock=clock)
    h = p.submit({"sim": {"sim-a": {"queue_s": 0, "run_s": 5, "cancel_terminal_s": 10}}})
    clock.advance(1)
    receipt = p.cancel(h)  # the job completes at 5 s, before the cancel would land at 11 s
    assert receipt.terminal_status is JobState.COMPLETED and clock.now() == pytest.approx(5.0)
    with pytest.raises(SubmitError, match="cancel_terminal_s must be seconds >= 0"):
        p.submit({"sim": {"sim-a": {"cancel_terminal_s": -1}}})


def test_redis_ledger_semantics(redis_url, prefix, redis_client):
    ledger = redis_ledger(redis_url, prefix)
    assert ledger.get("k") is None
    assert ledger.set_if_absent("k", '{"a": 1}', ttl_s=60) is True
    assert ledger.set_if_absent("k", '{"a": 2}', ttl_s=60) is False
    assert ledger.get("k") == '{"a": 1}'
    assert 0 < redis_client.pttl(f"{prefix}:k") <= 60_000
    assert [ledger.incr("n"), ledger.incr("n")] == [1, 2]
