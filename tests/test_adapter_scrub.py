"""Every adapter's text passes one scrubber: a job's own error that echoes a key, an error
body, a URL that carries a token. What the adapter keeps (the attempt's error, the cancel
receipt's note, an exception's message) never holds a credential it was configured with."""

from __future__ import annotations

import pytest

from gpuhedge_celery.config import parse_config
from gpuhedge_celery.core.jobs import JobHandle, JobState
from gpuhedge_celery.secrets import MASK, scrub_secrets
from tests.support.cerebrium_fake import KEY as CB_KEY
from tests.support.cerebrium_fake import FakeCerebrium, cerebrium_block
from tests.support.http_provider_server import HttpProviderServer
from tests.support.runpod_fake import KEY as RP_KEY
from tests.support.runpod_fake import runpod_provider
from tests.test_http import KEY as HTTP_KEY
from tests.test_http import make as make_http


def test_the_scrubber_masks_every_secret_longest_first():
    assert scrub_secrets("a sk-123456 b sk-1234", ["sk-1234", "sk-123456", "", None]) == (
        f"a {MASK} b {MASK}"
    )
    assert scrub_secrets("key abc", ["abc"]) == "key abc"  # too short to be a credential


def test_runpod_job_error_echoing_the_key_is_scrubbed(runpod):
    p = runpod_provider(runpod)
    fate = {"queue_s": 0.0, "run_s": 0.05, "outcome": "FAILED",
            "error": f"401 from upstream: bad key {RP_KEY}"}  # fmt: skip
    result = p.result(p.submit({"runpod_fake": {"*": fate}}), cap_s=10)
    assert result.state is JobState.FAILED and RP_KEY not in result.error and MASK in result.error


def test_http_job_error_echoing_the_key_is_scrubbed():
    with HttpProviderServer() as server:
        server.knobs.api_key = HTTP_KEY
        server.knobs.final_state = "FAILED"
        server.knobs.job_error = f"model refused header authorization={HTTP_KEY}"
        p = make_http(server)
        result = p.result(p.submit({}), cap_s=10)
    assert result.state is JobState.FAILED
    assert HTTP_KEY not in result.error and MASK in result.error


def test_an_http_url_token_is_a_secret_of_the_adapter():
    cfg = parse_config(
        {"providers": {"h": {"adapter": "http", "http": {
            "base_url": "https://api.example.com/v1?api_key=${TEST_API_TOKEN}&region=${REGION}",
            "submit": {"url": "/run", "job_id": "id"},
            "status": {"url": "/status/{job_id}", "state": "status"},
            "cancel": {"url": "/cancel/{job_id}"}}}}, "budget": {"ceiling_usd": 1}},
        source="t.yaml",
    )  # fmt: skip
    p = cfg.build("h", env={"TEST_API_TOKEN": "tok-SECRET-987", "REGION": "eu-west"})
    text = p.scrub("GET https://api.example.com/v1?api_key=tok-SECRET-987&region=eu-west")
    assert "tok-SECRET-987" not in text and "eu-west" in text  # a region is not a credential


@pytest.fixture(scope="module")
def cerebrium():
    with FakeCerebrium({}) as fake:
        yield fake


def test_cerebrium_error_body_echoing_the_key_is_scrubbed(cerebrium):
    cfg = parse_config(
        {"providers": {"cb": {"adapter": "cerebrium", "billed_rate_per_s": 0.001,
                              "cerebrium": cerebrium_block(cerebrium)}},
         "budget": {"ceiling_usd": 10}}, source="t.yaml",
    )  # fmt: skip
    p = cfg.build("cb", env={"CEREBRIUM_TEST_KEY": CB_KEY})
    h = JobHandle(provider="cb", job_id="run-1", submitted_at=0.0, extra={})
    result = p.webhook_result(h, {"error": f"auth failed for Bearer {CB_KEY}"})
    assert result.state is JobState.FAILED and CB_KEY not in result.error
