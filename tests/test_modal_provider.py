"""The ``modal`` adapter against the stand-in: a real loopback server (tests/support/modal_fake.py)
behind the adapter's one seam, reached through the real SDK client's exception mapping.

Submit, status and result; remote failures; expired outputs (outcome unknown); cancel evidence
(acknowledged, confirmed only by the input's observed end); SDK calls bounded by their timeouts
(a late spawn cancelled when its id comes); secrets never shown; the config block's errors.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time

import pytest

from gpuhedge_celery.config import load_config, parse_config, parse_config_text
from gpuhedge_celery.core.jobs import JobHandle, JobState
from gpuhedge_celery.core.receipts import CancelReceipt, CancelScope, Evidence
from gpuhedge_celery.errors import ConfigError, ProviderError, SubmitError
from gpuhedge_celery.providers.modal import ModalProvider
from gpuhedge_celery.providers.modal_sdk import INSTALL_HINT, SdkModalClient
from tests.support.modal_fake import GOOD_AUDIO, REPO, FakeModalServer
from tests.support.waiting import wait_for

FAKE = "tests.support.modal_fake_sdk:FakeModalClient"


@pytest.fixture
def server():
    with FakeModalServer() as s:
        yield s


def block(**extra):
    return {
        "app": "tts",
        "function": "synthesize",
        "payload": "audio_base64",
        "poll_interval_s": 0.02,
        "cancel_confirm_s": 2,
        "timeouts": {"spawn_s": 2, "poll_s": 1, "cancel_s": 1},
        "sdk": FAKE,
        "sdk_options": {"url": "${FAKE_URL}"},
        **extra,
    }


def build(server, name="m", env=None, **extra) -> ModalProvider:
    entry = {"adapter": "modal", "billed_rate_per_s": 0.001, "modal": block(**extra)}
    cfg = parse_config({"providers": {name: entry}, "budget": {"ceiling_usd": 100}})
    provider = cfg.build(name, env={"FAKE_URL": server.url, **(env or {})})
    assert isinstance(provider, ModalProvider)
    return provider


def calls(server):
    return server.control()["calls"]


# --- submit, status, result -----------------------------------------------------------------


def test_happy_path_and_a_handle_another_instance_can_use(server):
    p = build(server)
    assert p.reports_queue_state is False and p.adapter == "modal"
    request = {"text": "hello", "voice": "a"}
    h = p.submit(request)
    assert h.provider == "m" and h.job_id.startswith("fc-")
    assert abs(h.submitted_at - time.time()) < 5  # epoch seconds
    # the request travels as the function's one positional argument
    assert calls(server)[h.job_id]["request"] == request
    assert calls(server)[h.job_id]["target"] == "tts/synthesize"
    assert p.status(h) is JobState.IN_PROGRESS  # no queued state: never QUEUED
    other = build(server)
    rebuilt = JobHandle.from_json(json.dumps(json.loads(h.to_json())))
    r = other.result(rebuilt, cap_s=10)
    assert r.state is JobState.COMPLETED and r.payload == GOOD_AUDIO and r.job_id == h.job_id
    assert [e.stage for e in r.events][-1] == "completed" and 0 < r.wall_ms < 10_000
    assert other.status(rebuilt) is JobState.COMPLETED
    started = time.monotonic()
    assert p.result(h, cap_s=10).state is JobState.COMPLETED  # terminal: at once
    assert time.monotonic() - started < 0.5
    json.dumps(r.to_dict())


def test_class_method_target(server):
    p = build(server, function=None, cls="Synth", method="run", environment="dev")
    h = p.submit({"x": 1})
    assert calls(server)[h.job_id]["target"] == "tts/Synth.run"
    assert p.result(h, cap_s=10).state is JobState.COMPLETED


def test_whole_return_value_is_the_payload_without_a_path(server):
    server.knobs.output = {"text": "hi", "n": [1, 2]}
    p = build(server, payload=None)
    assert p.result(p.submit({}), cap_s=10).payload == {"text": "hi", "n": [1, 2]}


def test_missing_payload_field_is_a_failed_result(server):
    server.knobs.output = {"other": 1}
    r = build(server).result(build(server).submit({}), cap_s=10)
    assert r.state is JobState.FAILED and "'audio_base64'" in r.error


@pytest.mark.parametrize(
    "outcome, fragment",
    [
        ("remote_error", "RemoteError: container crashed"),
        ("user_exception", "the function raised ValueError: bad input"),
        ("function_timeout", "FunctionTimeoutError"),
        ("internal_failure", "InternalFailure"),
    ],
)
def test_remote_errors_are_failed_results(server, outcome, fragment):
    p = build(server)
    h = p.submit({"modal_fake": {"outcome": outcome}})
    r = p.result(h, cap_s=10)
    assert r.state is JobState.FAILED and fragment in r.error
    assert p.status(h) is JobState.FAILED


def test_expired_output_is_over_with_its_outcome_unknown(server):
    p = build(server)
    h = p.submit({"modal_fake": {"outcome": "expired"}})
    r = p.result(h, cap_s=10)
    assert r.state is JobState.FAILED and r.error.startswith("outcome unknown")
    assert r.metrics == {"outcome_unknown": True} and r.events[-1].stage == "expired"
    # a completed call read after its output expired: the same, not a crash
    server.knobs.expire_after_s = 0.05
    h = p.submit({})
    wait_for(lambda: calls(server)[h.job_id]["status"] == "expired", 5, "the output to expire")
    assert p.result(h, cap_s=10).error.startswith("outcome unknown")


def test_cap_right_censors_a_slow_call_and_leaves_it_running(server):
    p = build(server)
    h = p.submit({"modal_fake": {"run_s": 30}})
    started = time.monotonic()
    r = p.result(h, cap_s=0.4)
    assert r.state is JobState.TIMEOUT and r.wall_ms == 400.0
    assert time.monotonic() - started < 1.5
    assert not calls(server)[h.job_id]["cancelled"]


def test_unknown_function_is_a_submit_error(server):
    server.knobs.known_functions = ["tts/other"]
    with pytest.raises(SubmitError, match="Lookup failed for Function 'synthesize'"):
        build(server).submit({})


def test_poll_errors_are_ridden_out_up_to_max_poll_errors(server):
    p = build(server, max_poll_errors=3)
    h = p.submit({})
    server.knobs.poll_errors = 2
    assert p.result(h, cap_s=10).state is JobState.COMPLETED
    server.knobs.poll_errors = 5
    with pytest.raises(ProviderError, match="InternalError"):
        p.status(h)
    r = p.result(h, cap_s=10)
    assert r.state is JobState.FAILED and "3 failed polls in a row" in r.error


# --- cancel ---------------------------------------------------------------------------------


def test_cancel_is_acknowledged_then_confirmed_by_the_inputs_end(server):
    p = build(server)
    h = p.submit({"modal_fake": {"run_s": 30}})
    time.sleep(0.1)
    receipt = p.cancel(h)
    assert receipt.evidence is Evidence.CONFIRMED_TERMINAL and not receipt.leaked
    assert receipt.terminal_status is JobState.CANCELLED and receipt.scope is CancelScope.REQUEST
    assert receipt.cancel_sent_ms <= receipt.cancel_ack_ms <= receipt.terminal_ms
    assert receipt.billing_stop_confirmed is False and receipt.was_running is None
    assert "idles until Modal scales it down" in receipt.note
    assert receipt.estimated_cost_usd > 0 and receipt.reconciled_cost_usd is None
    assert calls(server)[h.job_id]["cancelled"] and calls(server)[h.job_id]["ended"]
    assert p.status(h) is JobState.FAILED  # Modal shows a cancelled input as a remote error
    CancelReceipt.from_dict(json.loads(json.dumps(receipt.to_dict())))


def test_cancel_whose_input_end_never_shows_stays_acknowledged_and_leaked(server):
    server.knobs.cancelled_reads_as = "pending"
    p = build(server, cancel_confirm_s=0.3)
    h = p.submit({"modal_fake": {"run_s": 30}})
    started = time.monotonic()
    receipt = p.cancel(h)
    assert time.monotonic() - started < 1.5  # bounded by cancel_confirm_s
    assert receipt.evidence is Evidence.PROVIDER_ACK and receipt.leaked
    assert not receipt.confirmed_terminal and receipt.terminal_status is None
    assert "had not ended 0.3 s after the cancel" in receipt.note
    assert receipt.estimated_cost_usd > 0


def test_cancel_confirmed_by_an_expired_output(server):
    server.knobs.cancelled_reads_as = "expired"
    p = build(server)
    receipt = p.cancel(p.submit({"modal_fake": {"run_s": 30}}))
    assert receipt.confirmed_terminal and receipt.terminal_status is JobState.CANCELLED
    assert "output expired" in receipt.note


def test_cancel_call_failing_leaves_no_evidence(server):
    p = build(server, cancel_confirm_s=0.2)
    h = p.submit({"modal_fake": {"run_s": 30}})
    server.knobs.cancel_errors = 1
    receipt = p.cancel(h)
    assert receipt.evidence is Evidence.NO_EVIDENCE and receipt.leaked
    assert "cancel call failed" in receipt.note and not calls(server)[h.job_id]["cancelled"]


def test_cancel_of_a_finished_call_reports_it_completed(server):
    p = build(server)
    h = p.submit({})
    p.result(h, cap_s=10)
    receipt = p.cancel(h)
    assert receipt.terminal_status is JobState.COMPLETED and receipt.scope is CancelScope.UNKNOWN
    assert "completed before the cancel" in receipt.note


def test_cancel_never_asks_to_terminate_containers(server):
    """The stand-in refuses terminate_containers=True (Modal did); the adapter's cancel works."""
    from tests.support.modal_fake_sdk import FakeModal

    p = build(server)
    h = p.submit({"modal_fake": {"run_s": 30}})
    fake = FakeModal(server.url)
    with pytest.raises(fake.exception.InvalidError):
        fake.FunctionCall.from_id(h.job_id).cancel(terminate_containers=True)
    assert p.cancel(h).cancel_ack_ms is not None


# --- bounded SDK calls ----------------------------------------------------------------------


def test_a_slow_poll_is_bounded_by_its_timeout(server):
    p = build(server, timeouts={"spawn_s": 2, "poll_s": 0.3, "cancel_s": 1})
    h = p.submit({"modal_fake": {"run_s": 30}})
    server.knobs.poll_delay_s = 2.0
    started = time.monotonic()
    with pytest.raises(ProviderError, match="poll did not answer within 0.3 s"):
        p.status(h)
    assert time.monotonic() - started < 1.5  # the 0.3 s timeout, not the 2 s the poll takes
    started = time.monotonic()
    r = p.result(h, cap_s=time.time() - h.submitted_at + 0.5)  # cap 0.5 s from now
    assert r.state in (JobState.TIMEOUT, JobState.FAILED)
    assert time.monotonic() - started < 1.5


def test_a_slow_spawn_is_outcome_unknown_and_its_late_call_is_cancelled(server, caplog):
    p = build(server, timeouts={"spawn_s": 0.3, "poll_s": 1, "cancel_s": 1})
    server.knobs.spawn_delay_s = 2.0  # the call exists at once; its id comes 2 s later
    started = time.monotonic()
    with caplog.at_level(logging.ERROR), pytest.raises(SubmitError) as caught:
        p.submit({"modal_fake": {"run_s": 30}})
    assert time.monotonic() - started < 1.5  # gave up at its timeout, never waited for the id
    assert "submit outcome unknown" in str(caught.value) and "tts/synthesize" in str(caught.value)
    [call_id] = calls(server)
    wait_for(lambda: calls(server)[call_id]["cancelled"], 10, "the late call to be cancelled")
    assert any(call_id in r.getMessage() for r in caplog.records)


def test_a_spawn_that_never_started_submitted_nothing(server):
    p = build(server, sdk_threads=1, timeouts={"spawn_s": 0.3, "poll_s": 2, "cancel_s": 1})
    h = p.submit({"modal_fake": {"run_s": 30}})
    server.knobs.poll_delay_s = 1.0
    busy = threading.Thread(target=p.status, args=(h,))
    busy.start()  # the only SDK thread is held by a slow poll
    time.sleep(0.1)
    with pytest.raises(SubmitError, match="nothing was submitted"):
        p.submit({})
    busy.join()  # the slow poll answers within its own 2 s bound
    time.sleep(0.3)
    assert server.control()["counts"]["spawn"] == 1  # the withdrawn spawn never ran


# --- secrets --------------------------------------------------------------------------------


def test_tokens_come_from_the_environment_and_never_show(server, monkeypatch, caplog):
    token_id, secret = "ak-sekrit-id-123", "as-sekrit-secret-456"
    server.knobs.token_id, server.knobs.token_secret = token_id, secret
    server.knobs.echo_token_in_errors = True  # an error text repeating the token
    monkeypatch.setenv("MODAL_TOKEN_ID", token_id)
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-wrong-secret")
    p = build(server, cancel_confirm_s=0.1)
    shown = []
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(SubmitError) as caught:
            p.submit({})
        shown.append(str(caught.value))
        assert "AuthError" in shown[0] and "***" in shown[0]
        handle = JobHandle("m", "fc-x", time.time())
        with pytest.raises(ProviderError) as caught:
            p.status(handle)
        shown.append(str(caught.value))
        shown.append(json.dumps(p.cancel(handle).to_dict()))
        shown.append(json.dumps(p.result(handle, cap_s=0.2).to_dict()))
    shown += [repr(p), caplog.text]
    for text in shown:
        assert token_id not in text and secret not in text and "as-wrong-secret" not in text
    monkeypatch.setenv("MODAL_TOKEN_SECRET", secret)
    assert build(server).result(build(server).submit({}), cap_s=10).state is JobState.COMPLETED


# --- config ---------------------------------------------------------------------------------


def config_error(modal_block, **provider):
    text = json.dumps(
        {
            "providers": {"m": {"adapter": "modal", **provider, "modal": modal_block}},
            "budget": {"ceiling_usd": 100},
        }
    )
    with pytest.raises(ConfigError) as caught:
        parse_config_text(text, source="my.yaml")
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"app": None}, "my.yaml: providers.m.modal.app: required key is missing"),
        ({"function": None}, "providers.m.modal.function: required key is missing (or give cls"),
        ({"cls": "Synth"}, "providers.m.modal.cls: give either function, or cls and method"),
        ({"function": None, "cls": "S"}, "providers.m.modal.method: required with cls"),
        ({"method": "run"}, "providers.m.modal.method: only valid with cls"),
        ({"sdk": "nocolon"}, "providers.m.modal.sdk: expected 'module:Class'"),
        ({"sdk": None}, "providers.m.modal.sdk_options: only valid with sdk"),
        ({"timeouts": {"poll_s": 0}}, "providers.m.modal.timeouts.poll_s: expected a number > 0"),
        ({"poll_intervl_s": 1}, "providers.m.modal.poll_intervl_s: unknown key; did you mean"),
        ({"sdk_threads": 0}, "providers.m.modal.sdk_threads: expected an integer >= 1"),
    ],
)
def test_config_errors_name_file_and_key(change, expected):
    data = {k: v for k, v in {**block(), **change}.items() if v is not None}
    assert expected in config_error(data)


def test_build_errors_name_the_key(server):
    with pytest.raises(ConfigError, match=r"providers\.m\.modal\.app: environment variable"):
        build(server, app="${NO_SUCH_APP_VAR}")
    cfg = parse_config({"providers": {"m": {"adapter": "modal", "modal": block(
        sdk="tests.support.nothing_here:X")}}, "budget": {"ceiling_usd": 100}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"providers\.m\.modal\.sdk: cannot import"):
        cfg.build("m", env={"FAKE_URL": server.url})


def test_app_from_the_environment(server):
    p = build(server, env={"APP": "voices"}, app="${APP}")
    h = p.submit({})
    assert calls(server)[h.job_id]["target"] == "voices/synthesize"


def test_without_the_modal_package_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "modal", None)  # `import modal` now fails
    data = {"app": "tts", "function": "f"}
    message = config_error(data)
    assert message == f"my.yaml: providers.m.modal: {INSTALL_HINT}"
    with pytest.raises(ConfigError, match=r"pip install 'gpuhedge-celery\[modal\]'"):
        SdkModalClient().poll("fc-1")
    # the stand-in needs no SDK install check at load (its own import is its business)
    data = {"providers": {"m": {"adapter": "modal", "modal": block()}}}
    parse_config({**data, "budget": {"ceiling_usd": 100}})


def test_the_sdk_is_imported_only_when_used():
    code = (
        "import sys\n"
        "from gpuhedge_celery.config import parse_config\n"
        "cfg = parse_config({'providers': {'m': {'adapter': 'modal',"
        " 'modal': {'app': 'a', 'function': 'f'}}}, 'budget': {'ceiling_usd': 100}})\n"
        "p = cfg.build('m')\n"
        "assert 'modal' not in sys.modules, 'loaded at build'\n"
        "p.client._modal()\n"
        "assert 'modal' in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_example_config_loads_and_builds():
    cfg = load_config(REPO / "config" / "modal.yaml")
    assert cfg.provider("modal").adapter == "modal" and cfg.provider("modal").role == "hedge"
    p = cfg.build("modal", env={})
    assert isinstance(p, ModalProvider) and p.target.label == "tts/synthesize"
    assert isinstance(p.client, SdkModalClient) and p.spec.payload == "audio_base64"
