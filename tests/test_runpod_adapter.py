"""The ``runpod`` adapter against the RunPod fake, a real HTTP server in its own process."""

from __future__ import annotations

import json
import time

import pytest

from gpuhedge_celery.config import parse_config
from gpuhedge_celery.core.jobs import JobHandle, JobState
from gpuhedge_celery.core.receipts import CancelReceipt, CancelScope, Evidence
from gpuhedge_celery.core.validators import validate
from gpuhedge_celery.errors import (
    ConfigError,
    ProviderError,
    ProviderProtocolError,
    RateLimited,
    SubmitError,
)
from gpuhedge_celery.providers.runpod import STATES, RunpodProvider
from gpuhedge_celery.providers.runpod_api import JobUnknown
from tests.support.runpod_fake import KEY, runpod_block, runpod_provider


def fate(queue_s: float, run_s: float, **more) -> dict:
    return {"runpod_fake": {"*": {"queue_s": queue_s, "run_s": run_s, **more}}}


def one_line(error: BaseException) -> str:
    text = str(error)
    assert len(text.splitlines()) == 1 and KEY not in text
    return text


def test_a_job_runs_queued_then_in_progress_then_completed(runpod):
    p = runpod_provider(runpod)
    h = p.submit(fate(0.15, 0.3))
    assert h.provider == "rp" and h.job_id and h.extra == {"endpoint": "ep1"}
    assert p.status(h) is JobState.QUEUED
    r = p.result(h, cap_s=10)
    assert r.state is JobState.COMPLETED and validate("wav", r.payload).ok
    assert [e.stage for e in r.events] == ["queued", "in_progress", "completed"]
    assert 140 <= r.metrics["delay_ms"] <= 200 and 290 <= r.metrics["execution_ms"] <= 350
    assert r.metrics["cost_usd"] == pytest.approx(r.metrics["execution_ms"] / 1000 * 0.001)
    # the result is served from the terminal answer the watch saw: no second status call
    calls = runpod.route("ep1", "status")["requests"]
    assert p.result(h, cap_s=10).state is JobState.COMPLETED
    assert runpod.route("ep1", "status")["requests"] == calls
    # another process (another provider object) rebuilds the handle from JSON
    other = runpod_provider(runpod)
    assert other.status(JobHandle.from_json(h.to_json())) is JobState.COMPLETED


@pytest.mark.parametrize(
    ("outcome", "state"), [("FAILED", JobState.FAILED), ("TIMED_OUT", JobState.FAILED)]
)
def test_failed_and_timed_out_jobs_end_without_payload(runpod, outcome, state):
    p = runpod_provider(runpod)
    r = p.result(p.submit(fate(0.0, 0.05, outcome=outcome)), cap_s=10)
    assert r.state is state and r.payload is None and r.error.startswith(outcome)
    assert r.metrics["runpod_status"] == outcome


def test_every_documented_state_is_mapped():
    assert {k: v.value for k, v in STATES.items()} == {
        "IN_QUEUE": "QUEUED", "IN_PROGRESS": "IN_PROGRESS", "RUNNING": "IN_PROGRESS",
        "COMPLETED": "COMPLETED", "FAILED": "FAILED", "CANCELLED": "CANCELLED",
        "TIMED_OUT": "FAILED",  # stopped by RunPod: ended, not censored by our cap
    }  # fmt: skip


def test_policy_and_webhook_travel_with_run(runpod):
    hook = "https://hooks.example/runpod/{race_id}/{attempt_id}/{token}"
    p = runpod_provider(runpod, policy={"executionTimeout": 60000, "lowPriority": True},
                        webhook=hook)  # fmt: skip
    h = p.submit(fate(0, 0.05), context={"race_id": "r1", "attempt_id": "a1", "token": "t"})
    options = runpod.job("ep1", h.job_id)["options"]
    assert options == {"policy": {"executionTimeout": 60000, "lowPriority": True},
                       "webhook": "https://hooks.example/runpod/r1/a1/t"}  # fmt: skip
    h = p.submit(fate(0, 0.05))  # no context (webhooks off): polled only
    assert "webhook" not in runpod.job("ep1", h.job_id)["options"]


def test_cancel_of_a_running_job_is_confirmed_by_status_not_by_its_reply(runpod):
    runpod.configure(cancel_stop_s=0.3)
    p = runpod_provider(runpod)
    h = p.submit(fate(0.0, 30))
    time.sleep(0.2)
    receipt = p.cancel(h)
    assert receipt.confirmed_terminal and not receipt.leaked
    assert receipt.evidence is Evidence.CONFIRMED_TERMINAL
    assert receipt.terminal_status is JobState.CANCELLED and receipt.was_running is True
    assert receipt.scope is CancelScope.REQUEST
    # the cancel answered "CANCELLED" at once; RunPod's own status showed it ~0.3 s later
    assert receipt.terminal_ms - receipt.cancel_ack_ms >= 250
    assert 400 <= receipt.execution_ms_before_cancel <= 1_200  # 0.2 s + 0.3 s, and any load
    assert receipt.reconciled_cost_usd == pytest.approx(receipt.execution_ms_before_cancel / 1e6)
    assert receipt.billing_stop_confirmed is True  # RunPod's terminal state, final executionTime
    assert runpod.job("ep1", h.job_id)["status"] == "CANCELLED"
    assert runpod.route("ep1", "cancel")["requests"] == 1
    CancelReceipt.from_dict(json.loads(json.dumps(receipt.to_dict())))


def test_cancel_of_a_queued_job_removes_it_and_costs_nothing(runpod):
    p = runpod_provider(runpod)
    h = p.submit(fate(30, 1))
    receipt = p.cancel(h)
    assert receipt.confirmed_terminal and receipt.terminal_status is JobState.CANCELLED
    assert receipt.was_running is False and receipt.scope is CancelScope.QUEUED_JOB
    assert receipt.execution_ms_before_cancel == 0.0 and receipt.reconciled_cost_usd == 0.0
    assert runpod.live() == []


def test_cancel_of_a_job_seen_ended_makes_no_call(runpod):
    p = runpod_provider(runpod)
    h = p.submit(fate(0, 0.05))
    assert p.result(h, cap_s=10).state is JobState.COMPLETED
    receipt = p.cancel(h)
    assert receipt.confirmed_terminal and receipt.terminal_status is JobState.COMPLETED
    assert "already COMPLETED" in receipt.note and receipt.scope is CancelScope.UNKNOWN
    assert runpod.route("ep1", "cancel")["requests"] == 0


def test_a_cancel_never_confirmed_is_leaked_and_says_so(runpod):
    runpod.configure(cancel_stop_s=60)
    p = runpod_provider(runpod, cancel_confirm_s=0.3)
    receipt = p.cancel(p.submit(fate(0, 30)))
    assert receipt.leaked and not receipt.confirmed_terminal
    assert receipt.evidence is Evidence.PROVIDER_ACK and not receipt.billing_stop_confirmed
    assert "no terminal state within 0.3 s" in receipt.note


def test_status_429_is_retried_after_retry_after(runpod):
    runpod.configure(window_s=1.0, limits={"status": 2})
    p = runpod_provider(runpod)  # its own bucket allows far more than the fake
    h = p.submit(fate(30, 1))
    started = time.monotonic()
    for _ in range(3):
        assert p.status(h) is JobState.QUEUED
    assert time.monotonic() - started >= 0.9  # waited for the Retry-After (1 s), not less
    stats = runpod.route("ep1", "status")
    assert stats["limited_429"] >= 1 and stats["requests"] == 3 + stats["limited_429"]


def test_a_429_longer_than_the_caller_may_wait_defers_the_poll(runpod):
    runpod.configure(window_s=5.0, limits={"status": 1})
    p = runpod_provider(runpod, retries={"max_block_s": 0.2, "backoff_s": 0.02})
    h = p.submit(fate(30, 1))
    p.status(h)
    time.sleep(0.05)  # past the window in which the submit's own answer serves
    with pytest.raises(RateLimited) as caught:
        p.status_and_next_change(JobHandle(h.provider, h.job_id, h.submitted_at - 5, h.extra))
    assert caught.value.retry_at >= time.time() + 0.5
    one_line(caught.value)


def test_a_watch_poll_never_waits_a_retry_or_a_token_it_is_deferred(runpod):
    p = runpod_provider(runpod, retries={"backoff_s": 0.5, "max_backoff_s": 1})
    h = p.submit(fate(30, 1))
    old = JobHandle(h.provider, h.job_id, h.submitted_at - 5, h.extra)
    runpod.configure(faults={"status": {"errors_next": 1, "error_code": 503}})
    time.sleep(0.05)  # past the window in which the submit's own answer serves
    started = time.monotonic()
    with pytest.raises(RateLimited) as caught:
        p.status_and_next_change(old)
    assert time.monotonic() - started < 0.4  # no backoff (0.5 s) slept in the timer thread
    assert "HTTP 503" in one_line(caught.value)
    assert time.time() + 0.1 <= caught.value.retry_at <= time.time() + 1.0
    assert p.status_and_next_change(old)[0] is JobState.QUEUED  # the deferred poll


def test_deferred_watch_polls_queue_for_distinct_slots_and_spend_them(runpod):
    # 2.6 tokens a second after a burst of 1: three jobs' polls at once get one send now and
    # two slots reserved ~0.38 s apart (up to a window ahead), not three wake-ups for the
    # same next token
    p = runpod_provider(runpod, rate_limits={"window_s": 1.0, "status": 4})
    handles = [p.submit(fate(30, 1)) for _ in range(3)]
    old = [JobHandle(h.provider, h.job_id, h.submitted_at - 5, h.extra) for h in handles]
    time.sleep(0.05)  # past the window in which the submits' own answers serve
    assert p.status_and_next_change(old[0])[0] is JobState.QUEUED
    slots = []
    for h in old[1:]:
        with pytest.raises(RateLimited) as caught:
            p.status_and_next_change(h)
        assert caught.value.reserved
        slots.append(caught.value.retry_at)
    gaps = [b - a for a, b in zip(slots, slots[1:], strict=False)]
    assert all(g == pytest.approx(1 / 2.6, abs=0.03) for g in gaps), gaps
    for h, slot in zip(old[1:], slots, strict=True):
        time.sleep(max(0.0, slot - time.time()))
        # its slot (carried by the watch's timer): no new token
        assert p.status_and_next_change(h, reserved=slot)[0] is JobState.QUEUED
    assert runpod.route("ep1", "status")["requests"] == 3


def test_5xx_is_retried_with_backoff_then_reported(runpod):
    p = runpod_provider(runpod)
    h = p.submit(fate(30, 1))
    runpod.configure(faults={"status": {"errors_next": 2, "error_code": 503}})
    assert p.status(h) is JobState.QUEUED
    assert runpod.route("ep1", "status")["faults"] == 2
    runpod.configure(faults={"status": {"errors_next": 10, "error_code": 500}})
    with pytest.raises(ProviderError) as caught:
        p.status(h)
    assert "provider 'rp'" in one_line(caught.value) and "HTTP 500" in str(caught.value)
    assert runpod.route("ep1", "status")["faults"] == 2 + 4  # the call and 3 retries


@pytest.mark.parametrize(
    ("fault", "unknown"),
    [
        ({"errors_next": 1, "error_code": 502}, True),  # a gateway may have created the job
        ({"malformed_next": 1}, True),  # accepted, but its id cannot be read
        ({"slow_next": 1, "slow_s": 3}, True),  # the answer never came (read timeout)
        ({"errors_next": 1, "error_code": 429, "retry_after": 1}, False),  # refused
        ({"errors_next": 1, "error_code": 400}, False),
    ],
    ids=["502", "malformed", "timeout", "429", "400"],
)
def test_a_submit_is_never_retried_and_says_whether_its_outcome_is_unknown(runpod, fault, unknown):
    runpod.configure(faults={"run": fault})
    p = runpod_provider(runpod, timeouts={"connect_s": 1, "read_s": 0.5})
    with pytest.raises(SubmitError) as caught:
        p.submit(fate(0, 0.05))
    text = one_line(caught.value)
    assert ("submit outcome unknown" in text) is unknown, text
    assert runpod.route("ep1", "run")["requests"] == 1


def test_a_submit_that_never_connected_is_not_unknown(runpod):
    block = runpod_block(runpod, base_url="http://127.0.0.1:9/v2")  # nothing listens there
    cfg = parse_config(
        {
            "providers": {"rp": {"adapter": "runpod", "runpod": block}},
            "budget": {"ceiling_usd": 1000},
        }
    )
    p = cfg.build("rp", env={"RUNPOD_TEST_KEY": KEY})
    p.api._limiter = runpod_provider(runpod).api.limiter  # noqa: SLF001 - no Redis needed
    with pytest.raises(SubmitError) as caught:
        p.submit({})
    assert "not sent" in one_line(caught.value) and "outcome unknown" not in str(caught.value)


@pytest.mark.parametrize(
    ("fault", "field"),
    [({"malformed_next": 1}, "not JSON"), ({"missing_next": 1}, "field 'status'")],
)
def test_a_malformed_status_is_one_line_naming_provider_and_field(runpod, fault, field):
    p = runpod_provider(runpod)
    h = p.submit(fate(30, 1))
    runpod.configure(faults={"status": fault})
    with pytest.raises(ProviderProtocolError) as caught:
        p.status(h)
    text = one_line(caught.value)
    assert text.startswith("provider 'rp': status GET /status/{id}") and field in text


def test_an_expired_result_ends_as_outcome_unknown_not_a_crash(runpod):
    runpod.configure(result_ttl_s=0.2)
    p = runpod_provider(runpod)
    h = p.submit(fate(0, 0.05))
    time.sleep(0.5)
    with pytest.raises(JobUnknown) as caught:
        p.status(h)
    assert "outcome unknown" in one_line(caught.value)
    r = p.result(h, cap_s=10)
    assert r.state is JobState.FAILED and "outcome unknown" in r.error
    receipt = p.cancel(h)
    assert receipt.leaked and not receipt.confirmed_terminal and "outcome unknown" in receipt.note


def test_no_secret_in_errors_receipts_or_repr(runpod):
    p = runpod_provider(runpod, key=KEY + "-wrong")
    with pytest.raises(SubmitError) as caught:
        p.submit({})
    assert "HTTP 401" in one_line(caught.value) and "-wrong" not in str(caught.value)
    good = runpod_provider(runpod)
    receipt = good.cancel(good.submit(fate(30, 1)))
    cfg = parse_config(
        {
            "providers": {"rp": {"adapter": "runpod", "runpod": runpod_block(runpod)}},
            "budget": {"ceiling_usd": 1000},
        }
    )
    for text in (repr(p), repr(good), repr(cfg.provider("rp")), json.dumps(receipt.to_dict())):
        assert KEY not in text


def test_submit_answers_the_first_watch_poll_without_a_request(runpod):
    p = runpod_provider(runpod, poll={"min_s": 0.5, "max_s": 2, "fraction": 0.25})
    h = p.submit(fate(30, 1))
    state, at = p.status_and_next_change(h)
    assert state is JobState.QUEUED and at == pytest.approx(time.time() + 0.5, abs=0.1)
    assert runpod.route("ep1", "status")["requests"] == 0


def test_polls_slow_down_far_from_the_start_and_near_idle_workers_speed_up(runpod):
    p = runpod_provider(runpod, poll={"min_s": 0.25, "max_s": 5, "fraction": 0.25},
                        health_interval_s=60)  # fmt: skip
    h = JobHandle("rp", "x", 1000.0)
    gap = lambda state, age: p.next_poll_at(h, state, 1000.0 + age) - (1000.0 + age)  # noqa: E731
    assert gap(JobState.IN_PROGRESS, 0.1) == 0.25  # min_s
    assert gap(JobState.IN_PROGRESS, 8.0) == pytest.approx(2.0)  # a quarter of its age
    assert gap(JobState.IN_PROGRESS, 600.0) == 5.0  # max_s
    assert gap(JobState.QUEUED, 8.0) == pytest.approx(2.0)  # no worker idle (the fake's default)
    runpod.configure(idle_workers=1)
    q = runpod_provider(runpod, endpoint="ep-idle", health_interval_s=60,
                        poll={"min_s": 0.25, "max_s": 5, "fraction": 0.25})  # fmt: skip
    assert q.next_poll_at(h, JobState.QUEUED, 1008.0) - 1008.0 == 0.25  # a worker is free


def test_health_is_read_once_per_interval_per_process_for_all_races(runpod):
    a = runpod_provider(runpod, endpoint="ep-h", health_interval_s=0.5)
    b = runpod_provider(runpod, endpoint="ep-h", health_interval_s=0.5)  # another provider name
    started = time.monotonic()
    while time.monotonic() - started < 1.2:
        assert a.health()["jobs"]["inQueue"] == 0 and b.health()["workers"]["idle"] == 0
        time.sleep(0.01)
    assert 2 <= runpod.route("ep-h", "health")["requests"] <= 3  # ~240 asks, 3 intervals


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"api_key": "rp_literal"}, "runpod.api_key: expected a ${VAR} reference"),
        ({"endpoint_id": None}, "runpod.endpoint_id: required key is missing"),
        ({"endpoint_id": ""}, "runpod.endpoint_id: expected a non-empty string"),
        ({"policy": {"executionTimeout": 100}}, "policy.executionTimeout: expected an integer"),
        ({"policy": {"priority": 1}}, "runpod.policy.priority: unknown key"),
        ({"webhook": "https://x/{race}"}, "runpod.webhook: unknown placeholder {race}"),
        ({"poll": {"min_s": 2, "max_s": 1}}, "poll.max_s: expected a number >= min_s"),
        ({"rate_limits": {"status": 0}}, "rate_limits.status: expected an integer >= 2"),
        ({"base_url": "ftp://x"}, "runpod.base_url: expected an http(s):// URL"),
        ({"endpoint": "x"}, "runpod.endpoint: unknown key; did you mean 'endpoint_id'?"),
    ],
)
def test_config_errors_are_one_line_naming_file_and_key(runpod, change, message):
    block = {**runpod_block(runpod), **change}
    block = {k: v for k, v in block.items() if v is not None}
    with pytest.raises(ConfigError) as caught:
        parse_config(
            {
                "providers": {"rp": {"adapter": "runpod", "runpod": block}},
                "budget": {"ceiling_usd": 1000},
            },
            source="rp.yaml",
        )
    text = one_line(caught.value)
    assert text.startswith("rp.yaml: providers.rp.") and message in text, text


def test_an_unset_key_is_named_when_the_provider_is_built(runpod):
    cfg = parse_config(
        {
            "providers": {"rp": {"adapter": "runpod", "runpod": runpod_block(runpod)}},
            "budget": {"ceiling_usd": 1000},
        }
    )
    with pytest.raises(ConfigError, match="providers.rp.runpod.api_key: environment variable "
                       "RUNPOD_TEST_KEY is not set"):  # fmt: skip
        cfg.build("rp", env={})


def test_the_example_config_loads():
    from pathlib import Path

    from gpuhedge_celery.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "config" / "runpod-native.yaml")
    p = cfg.build("runpod", env={"RUNPOD_API_KEY": "k", "RUNPOD_ENDPOINT_ID": "e",
                                 "RUNPOD_HEDGE_ENDPOINT_ID": "f"})  # fmt: skip
    assert isinstance(p, RunpodProvider) and p.api.root == "https://api.runpod.ai/v2/e"
    assert p.spec.limits["cancel"].limit == 100 and p.spec.limits["status"].limit == 2000
