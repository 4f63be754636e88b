"""The ``cerebrium`` adapter against its loopback fake (a real HTTP server in its own process).

Webhooks go to a recorder on loopback: the fake posts each run's response body there with
Cerebrium's retry behaviour (3 tries, never after a 5xx), so the tests see what a receiver
would, and what the adapter makes of it.
"""

from __future__ import annotations

import pytest

from gpuhedge_celery.config import parse_config
from gpuhedge_celery.core.jobs import JobState
from gpuhedge_celery.core.receipts import Evidence
from gpuhedge_celery.errors import ConfigError, SubmitError
from gpuhedge_celery.providers.base import TakesWebhooks
from tests.support.cerebrium_fake import KEY, FakeCerebrium, cerebrium_block
from tests.support.waiting import wait_for
from tests.support.webhook_server import Recorder

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def fake_process():
    with FakeCerebrium({"webhook_gap_s": 0.1}) as fake:
        yield fake


@pytest.fixture
def fake(fake_process):
    fake_process.reset()
    return fake_process


@pytest.fixture
def hooks():
    recorder = Recorder()
    yield recorder
    recorder.close()


def provider(fake, **overrides):
    cfg = parse_config(
        {
            "providers": {
                "cb": {
                    "adapter": "cerebrium",
                    "billed_rate_per_s": 0.001,
                    "cerebrium": cerebrium_block(fake, **overrides),
                }
            },
            "budget": {"ceiling_usd": 1000},
        },
        source="t.yaml",
    )
    return cfg.build("cb", env={"CEREBRIUM_TEST_KEY": KEY})


def fate(queue_s=0.0, run_s=0.05, **more):
    return {"text": "hi", "cerebrium_fake": {"queue_s": queue_s, "run_s": run_s, **more}}


def ctx(hooks, attempt="a1"):
    return {"race_id": "r1", "attempt_id": attempt, "token": "t",
            "url": f"{hooks.url}/hooks/r1/{attempt}/t"}  # fmt: skip


def test_submit_gets_the_run_id_and_the_webhook_brings_the_result(fake, hooks):
    p = provider(fake)
    h = p.submit(fate(), context=ctx(hooks))
    assert fake.run(h.job_id)["webhook"] == f"{hooks.url}/hooks/r1/a1/t"
    assert p.status(h) is JobState.IN_PROGRESS  # nothing asked: no status API for async runs
    (path, _, _), = hooks.wait(1)  # fmt: skip
    assert path == "/hooks/r1/a1/t"
    result = p.webhook_result(h, hooks.json(0))
    assert result.state is JobState.COMPLETED and result.payload.startswith("UklGR")
    assert fake.stats()["routes"] == {"submit": 1}


def test_a_failed_run_posts_its_error_and_ends_failed(fake, hooks):
    p = provider(fake)
    h = p.submit(fate(outcome="FAILED"), context=ctx(hooks))
    hooks.wait(1)
    result = p.webhook_result(h, hooks.json(0))
    assert result.state is JobState.FAILED and "run failed" in result.error


def test_without_a_webhook_receiver_nothing_is_sent(fake):
    p = provider(fake)
    with pytest.raises(SubmitError, match="GPUHEDGE_WEBHOOK_URL"):
        p.submit(fate())
    assert fake.stats()["routes"] == {}


def test_deliveries_are_retried_three_times_but_never_after_a_5xx(fake):
    refused = Recorder([404, 404, 404, 404])
    broken = Recorder([503])
    try:
        p = provider(fake)
        p.submit(fate(), context=ctx(refused))
        p.submit(fate(), context=ctx(broken, "a2"))
        assert len(refused.wait(3)) == 3 and len(broken.wait(1)) == 1
        gaps = [b[2] - a[2] for a, b in zip(refused.posts, refused.posts[1:], strict=False)]
        assert all(g >= 0.09 for g in gaps)
        # the fake counts a delivery once it has read its answer, after the receiver logged it
        stats = wait_for(
            lambda: (w := fake.stats()["webhooks"])["failed"] == 2 and w, 5, "two failed webhooks"
        )
        assert stats["failed"] == 2 and stats["attempts"] == 4
        assert len(refused.wait(4, timeout_s=0.5)) == 3  # no fourth try
    finally:
        refused.close()
        broken.close()


def test_a_dropped_webhook_ends_at_the_cap_as_outcome_unknown(fake, hooks):
    fake.configure(faults={"webhook": {"drop_next": 1}})
    p = provider(fake)
    h = p.submit(fate(), context=ctx(hooks))
    assert hooks.wait(1, timeout_s=0.6) == []
    result = p.result(h, 0.1)
    assert result.state is JobState.TIMEOUT and "outcome unknown" in result.error
    assert fake.stats()["webhooks"]["dropped"] == 1


def test_a_malformed_webhook_is_delivered_as_sent(fake, hooks):
    fake.configure(faults={"webhook": {"malformed_next": 1}})
    p = provider(fake)
    p.submit(fate(), context=ctx(hooks))
    hooks.wait(1)
    assert hooks.posts[0][1] == b'{"result": '


def test_cancel_is_acknowledged_only_and_a_queued_run_never_posts(fake, hooks):
    p = provider(fake)
    h = p.submit(fate(queue_s=0.3), context=ctx(hooks))
    receipt = p.cancel(h)
    assert receipt.evidence is Evidence.PROVIDER_ACK
    assert not receipt.confirmed_terminal and receipt.leaked and not receipt.billing_stop_confirmed
    assert hooks.wait(1, timeout_s=0.8) == []
    assert fake.run(h.job_id)["state"] == "CANCELLED"


def test_a_running_run_may_still_finish_after_its_cancel_and_post_its_webhook(fake, hooks):
    p = provider(fake)
    h = p.submit(fate(queue_s=0.0, run_s=0.3, finish_after_cancel=True), context=ctx(hooks))
    import time

    time.sleep(0.1)
    assert p.cancel(h).evidence is Evidence.PROVIDER_ACK
    hooks.wait(1)
    assert p.webhook_result(h, hooks.json(0)).state is JobState.COMPLETED


@pytest.mark.parametrize(
    ("fault", "unknown"),
    [({"errors_next": 1, "error_code": 502}, True), ({"errors_next": 1, "error_code": 400}, False),
     ({"malformed_next": 1}, True), ({"slow_next": 1, "slow_s": 3}, True)],
)  # fmt: skip
def test_submit_faults(fake, hooks, fault, unknown):
    fake.configure(faults={"submit": fault})
    p = provider(fake, timeouts={"connect_s": 1, "read_s": 0.5})
    with pytest.raises(SubmitError) as e:
        p.submit(fate(), context=ctx(hooks))
    assert bool(getattr(e.value, "outcome_unknown", False)) is unknown
    assert KEY not in str(e.value) and "\n" not in str(e.value)


def test_a_failed_cancel_is_a_leak_without_evidence(fake, hooks):
    fake.configure(faults={"cancel": {"errors_next": 1, "error_code": 500}})
    p = provider(fake)
    h = p.submit(fate(queue_s=1), context=ctx(hooks))
    receipt = p.cancel(h)
    assert receipt.evidence is Evidence.NO_EVIDENCE and receipt.leaked
    assert "HTTP 500" in receipt.note and KEY not in receipt.note


@pytest.mark.parametrize(
    ("change", "message"),
    [({"api_key": "literal"}, "t.yaml: providers.cb.cerebrium.api_key: expected a ${VAR}"),
     ({"api_url": "ftp://x"}, "providers.cb.cerebrium.api_url: expected an http(s):// URL"),
     ({"app": "a/b"}, "providers.cb.cerebrium.app: expected letters"),
     ({"bogus": 1}, "providers.cb.cerebrium")],
)  # fmt: skip
def test_config_errors_name_file_and_key(fake, change, message):
    with pytest.raises(ConfigError) as e:
        provider(fake, **change)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_example_config_builds_a_runpod_primary_hedged_by_cerebrium():
    from pathlib import Path

    from gpuhedge_celery.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "config" / "cerebrium.yaml")
    env = {"RUNPOD_ENDPOINT_ID": "ep", "RUNPOD_API_KEY": "k", "CEREBRIUM_PROJECT_ID": "p-9",
           "CEREBRIUM_API_KEY": KEY}  # fmt: skip
    p = cfg.build("cerebrium", env=env)
    assert p.adapter == "cerebrium" and isinstance(p, TakesWebhooks) and p.app_id == "p-9-tts"
    assert cfg.by_role("primary")[0].adapter == "runpod" and KEY not in repr(p)


@pytest.mark.parametrize("body", [[1, 2], 7, "text", None, {"result": None}, {"other": 1},
                                  {"result": {"audio_base64": 5}, "error": ""}])  # fmt: skip
def test_any_webhook_body_is_a_result_or_a_one_line_protocol_error(fake, hooks, body):
    from gpuhedge_celery.core.jobs import JobHandle
    from gpuhedge_celery.errors import ProviderProtocolError

    p = provider(fake)
    handle = JobHandle("cb", "run-1", 0.0)
    try:
        result = p.webhook_result(handle, body)
    except ProviderProtocolError as e:
        assert "\n" not in str(e) and "run-1" in str(e)
    else:
        assert result.state in (JobState.COMPLETED, JobState.FAILED)


def test_past_its_rate_limit_the_submit_is_refused_with_429_and_not_retried(fake, hooks):
    fake.configure(limits={"submit": 2}, window_s=10.0)
    p = provider(fake)
    p.submit(fate(), context=ctx(hooks))
    p.submit(fate(), context=ctx(hooks, "a2"))
    with pytest.raises(SubmitError, match="HTTP 429") as e:
        p.submit(fate(), context=ctx(hooks, "a3"))
    assert not getattr(e.value, "outcome_unknown", False)  # refused: no run was started
    assert fake.stats()["routes"] == {"submit": 3, "limited_429": 1}


REST_TOKEN = "cb-service-account-token-9876-very-secret"


def test_the_management_api_takes_its_own_token_when_one_is_set(fake, hooks):
    fake.configure(rest_token=REST_TOKEN)  # the service account's token differs from the key
    only_key = provider(fake)
    h = only_key.submit(fate(queue_s=1), context=ctx(hooks))  # inference: the key is right
    refused = only_key.cancel(h)
    assert refused.evidence is Evidence.NO_EVIDENCE and "HTTP 401" in refused.note
    both = parse_config(
        {"providers": {"cb": {"adapter": "cerebrium", "billed_rate_per_s": 0.001,
                              "cerebrium": cerebrium_block(
                                  fake, rest_token="${CEREBRIUM_TEST_REST_TOKEN}")}},
         "budget": {"ceiling_usd": 1000}}, source="t.yaml",
    ).build("cb", env={"CEREBRIUM_TEST_KEY": KEY,
                       "CEREBRIUM_TEST_REST_TOKEN": REST_TOKEN})  # fmt: skip
    h = both.submit(fate(queue_s=1), context=ctx(hooks))
    acked = both.cancel(h)
    assert acked.evidence is Evidence.PROVIDER_ACK and fake.run(h.job_id)["state"] == "CANCELLED"
    assert both.login_check().status == "ok"
    for text in (refused.note, acked.note, repr(both)):
        assert KEY not in text and REST_TOKEN not in text


def test_a_literal_rest_token_is_refused_naming_its_key(fake):
    with pytest.raises(ConfigError) as e:
        provider(fake, rest_token="literal-token")
    assert "providers.cb.cerebrium.rest_token: expected a ${VAR}" in str(e.value)


def test_the_default_inference_host_is_a_regional_one():
    from gpuhedge_celery.providers.cerebrium_spec import DEFAULT_API_URL

    assert DEFAULT_API_URL == "https://api.aws.us-east-1.cerebrium.ai"


def test_an_unset_rest_token_falls_back_to_the_inference_key(fake, hooks):
    p = provider(fake, rest_token="${CEREBRIUM_TEST_REST_TOKEN:-}")  # the variable is unset
    h = p.submit(fate(queue_s=1), context=ctx(hooks))
    assert p.cancel(h).evidence is Evidence.PROVIDER_ACK
