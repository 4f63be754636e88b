"""RunPod's job policy as a second stop: the provider's cap travels as ``executionTimeout``.

Our cap ends an attempt and asks for its job to be cancelled; under the fleet's ``/cancel``
budget that request may wait for a token. With the cap also in the job's own policy, RunPod
stops a job that outruns it by itself, whatever happens to our cancel.
"""

from __future__ import annotations

import time

import pytest

from gpuhedge_celery.config import parse_config
from gpuhedge_celery.core.jobs import JobState
from gpuhedge_celery.providers.ratelimit import LocalLimiter
from tests.support.runpod_fake import KEY, runpod_block

pytestmark = pytest.mark.timeout(60)


def provider(fake, timeout_s=None, **block):
    entry = {"adapter": "runpod", "billed_rate_per_s": 0.001, "runpod": runpod_block(fake, **block)}
    if timeout_s is not None:
        entry["timeout_s"] = timeout_s
    cfg = parse_config(
        {"providers": {"rp": entry}, "budget": {"ceiling_usd": 1000}}, source="t.yaml"
    )
    return cfg.build("rp", env={"RUNPOD_TEST_KEY": KEY}, limiter=LocalLimiter())


def fate(run_s: float) -> dict:
    return {"runpod_fake": {"*": {"queue_s": 0.0, "run_s": run_s}}}


@pytest.mark.parametrize(
    ("timeout_s", "policy", "sent"),
    [
        (30, {}, {"executionTimeout": 30000}),  # the cap, in milliseconds
        (2, {}, {"executionTimeout": 5001}),  # RunPod's floor: more than 5 s
        (30, {"executionTimeout": 90000}, {"executionTimeout": 90000}),  # the config's own wins
        # no cap of its own: the fleet's (timeouts.attempt_cap_s, 180 s by default)
        (None, {"ttl": 60000}, {"ttl": 60000, "executionTimeout": 180000}),
    ],
)
def test_the_cap_travels_as_the_jobs_execution_timeout(runpod, timeout_s, policy, sent):
    p = provider(runpod, timeout_s, policy=policy)
    h = p.submit(fate(0.05))
    assert runpod.job("ep1", h.job_id)["options"]["policy"] == sent


def test_runpod_stops_a_job_past_its_cap_with_no_cancel_sent(runpod):
    runpod.configure(faults={"cancel": {"errors_next": 100, "error_code": 500}})
    p = provider(runpod, timeout_s=5.5)  # executionTimeout 5500 ms
    h = p.submit(fate(60.0))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and runpod.job("ep1", h.job_id)["status"] != "TIMED_OUT":
        time.sleep(0.2)
    job = runpod.job("ep1", h.job_id)
    assert job["status"] == "TIMED_OUT" and job["cancelled"] is False
    assert job["executionTime"] == pytest.approx(5500, abs=5)  # billed to the cap, not 60 s
    result = p.result(h, 10.0)  # ended, priced from RunPod's own figure
    assert (
        result.state is JobState.FAILED and result.metrics["execution_ms"] == job["executionTime"]
    )
