"""What the native adapters count in the provider metrics, against their loopback fakes.

RunPod (its fake in its own process, answering 429 once), Cerebrium (its fake process) and
Modal (its stand-in server behind the real SDK client's mapping): each call the adapter makes
is one ``gpuhedge_provider_requests_total`` under the ``http`` adapter's route labels, and each
failed one a ``gpuhedge_provider_errors_total`` by kind. Tests read prometheus_client's default
registry before and after (``Delta``), so they never depend on one another.
"""

from __future__ import annotations

import time

import pytest

from gpuhedge_celery.errors import ProviderError, SubmitError
from gpuhedge_celery.metrics import record
from tests.support.runpod_fake import runpod_provider
from tests.test_metrics_record import Delta

pytestmark = pytest.mark.timeout(60)

REQUESTS, ERRORS = "gpuhedge_provider_requests_total", "gpuhedge_provider_errors_total"


@pytest.fixture(autouse=True)
def metrics_on():
    assert record.active()  # prometheus_client is a test dependency


def runpod_fate(queue_s: float, run_s: float) -> dict:
    return {"runpod_fake": {"*": {"queue_s": queue_s, "run_s": run_s}}}


def test_runpod_counts_a_retried_429_and_each_send(runpod):
    p = runpod_provider(runpod)
    d = Delta()
    h = p.submit(runpod_fate(30, 1))
    sent = runpod.route("ep1", "status")["requests"]
    runpod.configure(faults={"status": {"errors_next": 1, "error_code": 429}})
    p.status(h)  # 429, retried after its backoff, then answered
    assert runpod.route("ep1", "status")["requests"] == sent + 2  # both sends reached RunPod
    p.cancel(h)
    assert d.of(REQUESTS, provider="rp", route="submit") == 1
    assert d.of(ERRORS, provider="rp", route="submit", kind="http") == 0
    assert d.of(REQUESTS, provider="rp", route="status") >= 2  # the cancel's confirming polls too
    assert d.of(ERRORS, provider="rp", route="status", kind="rate_limited") == 1
    assert d.of(ERRORS, provider="rp", route="status", kind="http") == 0
    assert d.of(REQUESTS, provider="rp", route="cancel") == 1


def test_runpod_counts_a_failed_submit_and_a_5xx_by_kind(runpod):
    p = runpod_provider(runpod, retries={"attempts": 1, "backoff_s": 0.02, "max_block_s": 3})
    d = Delta()
    runpod.configure(faults={"run": {"errors_next": 1, "error_code": 502}})
    with pytest.raises(SubmitError, match="submit outcome unknown"):
        p.submit(runpod_fate(30, 1))
    h = p.submit(runpod_fate(30, 1))
    runpod.configure(faults={"status": {"errors_next": 2, "error_code": 503}})
    with pytest.raises(ProviderError, match="HTTP 503"):
        p.status(h)  # sent, retried once, given up
    assert d.of(REQUESTS, provider="rp", route="submit") == 2
    assert d.of(ERRORS, provider="rp", route="submit", kind="http") == 1
    assert d.of(REQUESTS, provider="rp", route="status") == 2
    assert d.of(ERRORS, provider="rp", route="status", kind="http") == 2


@pytest.fixture(scope="module")
def cerebrium():
    from tests.support.cerebrium_fake import FakeCerebrium

    with FakeCerebrium({"webhook_gap_s": 0.1}) as fake:
        yield fake


def test_cerebrium_counts_its_submit_its_cancel_and_a_429(cerebrium):
    from gpuhedge_celery.config import parse_config
    from tests.support.cerebrium_fake import KEY, cerebrium_block
    from tests.support.webhook_server import Recorder

    cerebrium.reset()
    cerebrium.configure(limits={"submit": 1}, window_s=10.0)
    entry = {"adapter": "cerebrium", "billed_rate_per_s": 0.001,
             "cerebrium": cerebrium_block(cerebrium)}  # fmt: skip
    cfg = parse_config({"providers": {"cb": entry}, "budget": {"ceiling_usd": 1000}})
    p = cfg.build("cb", env={"CEREBRIUM_TEST_KEY": KEY})
    hooks = Recorder()
    try:
        context = {"url": f"{hooks.url}/hooks/r1/a1/t"}
        d = Delta()
        h = p.submit({"cerebrium_fake": {"queue_s": 5, "run_s": 1}}, context=context)
        with pytest.raises(SubmitError, match="HTTP 429"):
            p.submit({"cerebrium_fake": {"queue_s": 5, "run_s": 1}}, context=context)
        p.status(h)  # asks nothing: counts nothing
        p.cancel(h)
    finally:
        hooks.close()
    assert cerebrium.stats()["routes"] == {"submit": 2, "limited_429": 1, "cancel": 1}
    assert d.of(REQUESTS, provider="cb", route="submit") == 2
    assert d.of(ERRORS, provider="cb", route="submit", kind="rate_limited") == 1
    assert d.of(REQUESTS, provider="cb", route="status") == 0
    assert d.of(REQUESTS, provider="cb", route="cancel") == 1
    assert d.of(ERRORS, provider="cb", route="cancel", kind="http") == 0


def test_modal_counts_its_sdk_calls_under_the_routes_they_serve(tmp_path):
    from gpuhedge_celery.config import parse_config
    from tests.support.modal_fake import FakeModalServer

    with FakeModalServer() as server:
        block = {"app": "tts", "function": "synthesize", "payload": "audio_base64",
                 "poll_interval_s": 0.02, "cancel_confirm_s": 2,
                 "timeouts": {"spawn_s": 2, "poll_s": 0.3, "cancel_s": 1},
                 "sdk": "tests.support.modal_fake_sdk:FakeModalClient",
                 "sdk_options": {"url": server.url}}  # fmt: skip
        entry = {"adapter": "modal", "billed_rate_per_s": 0.001, "modal": block}
        cfg = parse_config({"providers": {"m": entry}, "budget": {"ceiling_usd": 100}})
        p = cfg.build("m")
        d = Delta()
        h = p.submit({"modal_fake": {"run_s": 30}})
        server.knobs.poll_errors = 1  # the SDK raises: an error without an HTTP status
        with pytest.raises(ProviderError):
            p.status(h)
        server.knobs.poll_delay_s = 1.0  # over the poll's 0.3 s bound
        with pytest.raises(ProviderError, match="did not answer"):
            p.status(h)
        server.knobs.poll_delay_s = 0.0
        time.sleep(0.05)
        p.status(h)
        p.cancel(h)  # the cancel, then polls until the input is seen ended
    assert d.of(REQUESTS, provider="m", route="submit") == 1
    assert d.of(ERRORS, provider="m", route="status", kind="rejected") == 1
    assert d.of(ERRORS, provider="m", route="status", kind="timeout") == 1
    assert d.of(REQUESTS, provider="m", route="status") >= 4  # 3 asked here, 1+ by the cancel
    assert d.of(REQUESTS, provider="m", route="cancel") == 1
    assert d.of(ERRORS, provider="m", route="cancel", kind="rejected") == 0
