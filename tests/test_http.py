"""The http adapter against a real HTTP server on loopback that speaks a RunPod-like API."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest

from gpuhedge_celery.config import load_config, parse_config
from gpuhedge_celery.core.clock import MonotonicClock, WallClock
from gpuhedge_celery.core.jobs import JobHandle, JobState
from gpuhedge_celery.core.receipts import CancelScope, Evidence
from gpuhedge_celery.core.validators import validate
from gpuhedge_celery.errors import (
    ConfigError,
    ProviderError,
    ProviderProtocolError,
    SubmitError,
)
from gpuhedge_celery.providers.http import HttpProvider
from tests.support.http_provider_server import HttpProviderServer

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-very-secret-123"

BLOCK = {
    "base_url": "${API}/v2/ep1",
    "headers": {"authorization": "${KEY}"},
    "timeouts": {"connect_s": 2, "read_s": 2},
    "poll_interval_s": 0.02,
    "cancel_confirm_s": 2,
    "submit": {"url": "/run", "body": {"input": "{request}"}, "job_id": "id"},
    "status": {
        "url": "/status/{job_id}",
        "state": "status",
        "payload": "output.audio_base64",
        "error": "error",
        "metrics": {"delay_ms": "delayTime", "execution_ms": "executionTime"},
    },
    "cancel": {"url": "/cancel/{job_id}"},
}


@pytest.fixture
def server():
    with HttpProviderServer() as s:
        s.knobs.api_key = KEY
        yield s


def make(server, env=None, **overrides) -> HttpProvider:
    block = copy.deepcopy(BLOCK)
    for key, value in overrides.items():
        block[key] = value
    cfg = parse_config(
        {
            "providers": {"rp": {"adapter": "http", "billed_rate_per_s": 0.001, "http": block}},
            "budget": {"ceiling_usd": 100},
        },
        source="t.yaml",
    )
    provider = cfg.build("rp", env={"API": server.url, "KEY": KEY, **(env or {})})
    assert isinstance(provider, HttpProvider)
    return provider


def no_secret(*texts: object) -> None:
    for text in texts:
        assert KEY not in str(text)


def test_happy_path(server):
    p = make(server)
    h = p.submit({"text": "hello"})
    assert p.status(h) in (JobState.QUEUED, JobState.IN_PROGRESS)
    r = p.result(h, cap_s=10)
    assert r.state is JobState.COMPLETED and validate("wav", r.payload).ok
    assert [e.stage for e in r.events][-1] == "completed"
    assert r.metrics["delay_ms"] >= 40 and r.metrics["execution_ms"] >= 90
    assert r.metrics["cost_usd"] == pytest.approx(r.metrics["execution_ms"] / 1000 * 0.001)
    run = server.ops("run")[0]
    assert run.body == {"input": {"text": "hello"}}
    assert run.headers["authorization"] == KEY
    # an already-terminal job answers at once: one status call, no sleeping
    before = len(server.ops("status"))
    started = time.monotonic()
    assert p.result(h, cap_s=10).state is JobState.COMPLETED
    assert len(server.ops("status")) == before + 1 and time.monotonic() - started < 1.0
    no_secret(repr(p), repr(load_like(server)))


def load_like(server):
    return parse_config(
        {"providers": {"rp": {"adapter": "http", "http": BLOCK}}, "budget": {"ceiling_usd": 100}}
    ).provider("rp")


def test_handle_rebuilt_from_json_by_another_provider_instance(server):
    h = make(server).submit({"x": 1})
    other = make(server)
    assert other.result(JobHandle.from_json(h.to_json()), cap_s=10).state is JobState.COMPLETED


def test_job_failure_is_reported_with_its_error(server):
    server.knobs.final_state = "FAILED"
    p = make(server)
    r = p.result(p.submit({}), cap_s=10)
    assert r.state is JobState.FAILED and r.error == "worker crashed" and r.payload is None


def test_submit_500_is_a_submit_error(server):
    server.knobs.submit_errors = 1
    with pytest.raises(SubmitError) as info:
        make(server).submit({})
    message = str(info.value)
    assert "provider 'rp'" in message and "submit POST /run" in message and "HTTP 500" in message
    no_secret(message)


def test_status_500s_are_ridden_out_up_to_max_poll_errors(server):
    p = make(server)
    h = p.submit({})
    server.knobs.status_errors = 1
    with pytest.raises(ProviderError, match="status GET /status/{job_id}.*HTTP 500"):
        p.status(h)
    server.knobs.status_errors = 2  # fewer than max_poll_errors (3) in a row: recovered
    assert p.result(h, cap_s=10).state is JobState.COMPLETED
    h2 = p.submit({})
    server.knobs.status_errors = 3
    r = p.result(h2, cap_s=10)
    assert r.state is JobState.FAILED and "3 failed polls in a row" in r.error
    no_secret(r.error)


def test_submit_timeout(server):
    server.knobs.submit_delay_s = 1.5
    p = make(server, timeouts={"connect_s": 1, "read_s": 0.3})
    started = time.monotonic()
    with pytest.raises(SubmitError, match="timed out.*may exist"):
        p.submit({})
    assert time.monotonic() - started < 1.4


def test_slow_status_never_holds_result_past_the_cap(server):
    server.knobs.queue_s = 30
    p = make(server)
    h = p.submit({})
    server.knobs.status_delay_s = 1.0
    started = time.monotonic()
    r = p.result(h, cap_s=0.8)
    elapsed = time.monotonic() - started
    assert r.state in (JobState.TIMEOUT, JobState.FAILED)
    assert elapsed < 2.0  # each poll's read timeout is clamped to the time left


def test_cap_right_censors_a_slow_job(server):
    server.knobs.queue_s = 30
    p = make(server)
    r = p.result(p.submit({}), cap_s=0.3)
    assert r.state is JobState.TIMEOUT and r.wall_ms == 300.0
    assert [e.stage for e in r.events] == ["queued", "timeout"]


def test_malformed_json(server):
    p = make(server)
    server.knobs.malformed = {"submit"}
    with pytest.raises(ProviderProtocolError, match="submit POST /run: response is not JSON"):
        p.submit({})
    server.knobs.malformed = set()
    h = p.submit({})
    server.knobs.malformed = {"status"}
    with pytest.raises(ProviderProtocolError, match="status GET /status/{job_id}.*not JSON"):
        p.status(h)
    r = p.result(h, cap_s=5)
    assert r.state is JobState.FAILED and "not JSON" in r.error


@pytest.mark.parametrize(
    "omit,call,fragment",
    [
        ("id", "submit", "response has no field 'id' (job_id)"),
        ("status", "status", "response has no field 'status' (state)"),
        ("output", "result", "response has no field 'output.audio_base64' (payload)"),
    ],
)
def test_missing_fields_name_the_field(server, omit, call, fragment):
    p = make(server)
    h = p.submit({}) if call != "submit" else None
    server.knobs.omit = {omit}
    if call == "submit":
        with pytest.raises(ProviderProtocolError, match="provider 'rp'") as info:
            p.submit({})
        assert fragment in str(info.value)
    elif call == "status":
        with pytest.raises(ProviderProtocolError) as info:
            p.status(h)
        assert fragment in str(info.value)
    else:
        r = p.result(h, cap_s=5)
        assert r.state is JobState.FAILED and fragment in r.error


def test_state_map_over_case_insensitive_defaults(server):
    p = make(server, state_map={"done": "completed"})
    h = p.submit({})
    server.knobs.state_override = "in_queue"
    assert p.status(h) is JobState.QUEUED
    server.knobs.state_override = "Running"
    assert p.status(h) is JobState.IN_PROGRESS
    server.knobs.state_override = "DONE"
    assert p.status(h) is JobState.COMPLETED
    server.knobs.state_override = "SOMETHING_NEW"
    assert p.status(h) is JobState.UNKNOWN


def test_cancel_running_job_is_confirmed_by_status_not_by_the_cancel_reply(server):
    server.knobs.queue_s, server.knobs.run_s = 0.0, 30
    server.knobs.cancel_terminal_after_s = 0.3
    p = make(server)
    h = p.submit({})
    time.sleep(0.2)
    receipt = p.cancel(h)
    assert receipt.confirmed_terminal and not receipt.leaked
    assert receipt.evidence is Evidence.CONFIRMED_TERMINAL
    assert receipt.terminal_status is JobState.CANCELLED and receipt.was_running is True
    assert receipt.scope is CancelScope.REQUEST
    # the cancel replied "CANCELLED" at once, but terminal was only seen ~0.3 s later
    assert receipt.terminal_ms - receipt.cancel_ack_ms >= 250
    assert len(server.ops("status")) >= 3
    assert receipt.execution_ms_before_cancel >= 400
    assert receipt.reconciled_cost_usd == pytest.approx(receipt.execution_ms_before_cancel / 1e6)
    # an execution time alone proves nothing about billing: a generic API must declare it
    assert receipt.billing_stop_confirmed is False


def test_billing_stop_is_confirmed_only_by_an_observed_terminal_state_when_declared(server):
    server.knobs.queue_s, server.knobs.run_s = 0.0, 30
    server.knobs.cancel_terminal_after_s = 0.2
    p = make(server, terminal_stops_billing=True)
    receipt = p.cancel(p.submit({}))
    assert receipt.confirmed_terminal and receipt.billing_stop_confirmed is True
    server.knobs.cancel_never_terminal = True  # "CANCELLED" in the reply, never in a status
    p = make(server, terminal_stops_billing=True, cancel_confirm_s=0.3)
    receipt = p.cancel(p.submit({}))
    assert receipt.leaked and receipt.billing_stop_confirmed is False


def test_slow_cancel(server):
    server.knobs.queue_s, server.knobs.run_s = 0.0, 30
    server.knobs.cancel_delay_s = 0.6
    p = make(server)
    h = p.submit({})
    receipt = p.cancel(h)
    assert receipt.cancel_ack_ms - receipt.cancel_sent_ms >= 550
    assert receipt.confirmed_terminal and receipt.terminal_status is JobState.CANCELLED


def test_cancel_while_queued_costs_nothing(server):
    server.knobs.queue_s = 30
    p = make(server)
    receipt = p.cancel(p.submit({}))
    assert receipt.scope is CancelScope.QUEUED_JOB and receipt.was_running is False
    assert receipt.execution_ms_before_cancel == 0.0 and receipt.reconciled_cost_usd == 0.0


def test_cancel_that_never_reaches_terminal_is_a_leaked_receipt(server):
    server.knobs.queue_s, server.knobs.run_s = 0.0, 60
    server.knobs.cancel_never_terminal = True
    p = make(server, cancel_confirm_s=0.5)
    h = p.submit({})
    started = time.monotonic()
    receipt = p.cancel(h)
    assert time.monotonic() - started < 3.0
    assert receipt.leaked and not receipt.confirmed_terminal
    assert receipt.evidence is Evidence.PROVIDER_ACK  # the 200 is only an acknowledgement
    assert receipt.terminal_status is None and receipt.cancel_ack_ms is not None
    assert "no terminal state within 0.5 s" in receipt.note
    assert receipt.estimated_cost_usd > 0
    no_secret(receipt.to_dict())


def test_cancel_call_failing_leaves_no_evidence(server):
    server.knobs.queue_s, server.knobs.run_s = 0.0, 60
    server.knobs.cancel_errors = 1
    p = make(server, cancel_confirm_s=0.3)
    receipt = p.cancel(p.submit({}))
    assert receipt.evidence is Evidence.NO_EVIDENCE and receipt.leaked
    assert "cancel call failed" in receipt.note and "HTTP 500" in receipt.note


def test_cancel_of_a_finished_job(server):
    p = make(server)
    h = p.submit({})
    p.result(h, cap_s=10)
    receipt = p.cancel(h)
    assert receipt.terminal_status is JobState.COMPLETED and "already COMPLETED" in receipt.note
    assert server.ops("cancel") == []  # nothing to stop, nothing sent


def test_job_ids_with_slash_and_question_mark(server):
    server.knobs.job_id_template = "tenant/a?b=1&n={n}#x"
    server.knobs.queue_s, server.knobs.run_s = 0.0, 30
    p = make(server)
    h = p.submit({})
    assert h.job_id == "tenant/a?b=1&n=1#x"
    assert p.status(h) is JobState.IN_PROGRESS
    receipt = p.cancel(h)
    assert receipt.confirmed_terminal
    for seen in server.ops("status") + server.ops("cancel"):
        assert seen.job_id == h.job_id and "%2F" in seen.raw_path and "%3F" in seen.raw_path


def test_missing_env_variable_is_a_one_line_config_error(server):
    with pytest.raises(ConfigError) as info:
        make(server, env={"KEY": ""})
    message = str(info.value)
    assert message == (
        "t.yaml: providers.rp.http.headers.authorization: environment variable KEY is not set"
    )
    with pytest.raises(ConfigError, match=r"providers\.rp\.http\.base_url: .*API is not set"):
        data = {"providers": {"rp": {"adapter": "http", "http": BLOCK}}}
        parse_config({**data, "budget": {"ceiling_usd": 100}}).build("rp", env={})


def test_unauthorized_error_does_not_leak_the_key(server):
    server.knobs.api_key = "another-key"
    p = make(server)
    with pytest.raises(SubmitError, match="HTTP 401") as info:
        p.submit({})
    no_secret(info.value, repr(p))


def test_http_example_config_runs_against_the_loopback_server(server, monkeypatch):
    monkeypatch.setenv("RUNPOD_API_BASE", server.url)
    monkeypatch.setenv("RUNPOD_ENDPOINT_ID", "ep-example")
    monkeypatch.setenv("RUNPOD_API_KEY", KEY)
    cfg = load_config(ROOT / "config" / "http-example.yaml")
    provider = cfg.build("runpod", clock=WallClock())
    h = provider.submit({"text": "hello"})
    r = provider.result(h, cap_s=cfg.cap_s("runpod"))
    assert r.state is JobState.COMPLETED
    assert validate(cfg.validator.name, r.payload, **cfg.validator.options).ok
    assert server.ops("run")[0].raw_path == "/v2/ep-example/run"
    no_secret(repr(cfg), repr(provider))


def test_runpod_preset_builds_both_endpoints_and_runs(server, monkeypatch):
    monkeypatch.setenv("RUNPOD_API_BASE", server.url)
    monkeypatch.setenv("RUNPOD_ENDPOINT_ID", "cheap")
    monkeypatch.setenv("RUNPOD_HEDGE_ENDPOINT_ID", "warm")
    monkeypatch.setenv("RUNPOD_API_KEY", KEY)
    cfg = load_config(ROOT / "config" / "runpod.yaml")
    assert [p.name for p in cfg.by_role("hedge")] == ["runpod-hedge"]
    hedge = cfg.build("runpod-hedge", clock=MonotonicClock())
    r = hedge.result(hedge.submit({"text": "x"}), cap_s=10)
    assert r.state is JobState.COMPLETED
    assert server.ops("run")[0].raw_path == "/v2/warm/run"


def test_separate_result_call_with_list_index_path(server):
    status = {**BLOCK["status"]}
    del status["payload"]
    p = make(server, status=status, result={"url": "/result/{job_id}", "payload": "data.0.audio"})
    r = p.result(p.submit({}), cap_s=10)
    assert r.state is JobState.COMPLETED and validate("wav", r.payload).ok
    assert len(server.ops("result")) == 1
    bad = make(server, status=status, result={"url": "/result/{job_id}", "payload": "data.1.audio"})
    r = bad.result(bad.submit({}), cap_s=10)
    assert r.state is JobState.FAILED and "no field 'data.1.audio' (payload)" in r.error
