"""The four-method contract, checked the same way on every built-in adapter (sim, http, runpod).

A new adapter can be added to ``ADAPTERS`` and must pass the same rows.
"""

from __future__ import annotations

import json
import time

import pytest

from gpuhedge_celery.config import parse_config
from gpuhedge_celery.core.clock import WallClock
from gpuhedge_celery.core.jobs import AttemptResult, JobHandle, JobState
from gpuhedge_celery.core.receipts import CancelReceipt, Evidence
from gpuhedge_celery.providers.base import Provider
from gpuhedge_celery.providers.sim import MemoryLedger
from tests.support.http_provider_server import HttpProviderServer

KEY = "contract-key"


class SimHarness:
    """Drives sim jobs: ``fast`` completes in ~0.1 s real time, ``slow`` needs ~30 s."""

    def __init__(self):
        self.ledger = MemoryLedger()

    def provider(self) -> Provider:
        cfg = parse_config({"providers": {"s": {"adapter": "sim", "billed_rate_per_s": 0.001,
                                                "sim": {"time_scale": 0.01}}}})  # fmt: skip
        return cfg.build("s", clock=WallClock(), ledger=self.ledger)

    def request(self, kind: str) -> dict:
        times = {"fast": (2, 8), "slow": (0, 3000), "queued": (3000, 10)}[kind]
        return {"sim": {"s": {"queue_s": times[0], "run_s": times[1]}}}

    def close(self) -> None:
        pass


class HttpHarness:
    """Drives jobs on the loopback RunPod-like server; per-job timings set through knobs."""

    def __init__(self):
        self.server = HttpProviderServer()
        self.server.knobs.api_key = KEY

    def provider(self) -> Provider:
        block = {
            "base_url": "${API}/v2/contract",
            "headers": {"authorization": "${KEY}"},
            "poll_interval_s": 0.02,
            "cancel_confirm_s": 3,
            "submit": {"url": "/run", "body": {"input": "{request}"}, "job_id": "id"},
            "status": {
                "url": "/status/{job_id}",
                "state": "status",
                "payload": "output.audio_base64",
                "metrics": {"execution_ms": "executionTime"},
            },  # fmt: skip
            "cancel": {"url": "/cancel/{job_id}"},
        }
        cfg = parse_config({"providers": {"h": {"adapter": "http", "billed_rate_per_s": 0.001,
                                                "http": block}},
                            "budget": {"ceiling_usd": 100}})  # fmt: skip
        return cfg.build("h", env={"API": self.server.url, "KEY": KEY})

    def request(self, kind: str) -> dict:
        knobs = self.server.knobs
        knobs.queue_s, knobs.run_s = {"fast": (0.02, 0.08), "slow": (0.0, 30.0),
                                      "queued": (30.0, 0.1)}[kind]  # fmt: skip
        return {"kind": kind}

    def close(self) -> None:
        self.server.stop()


class RunpodHarness:
    """Drives jobs on the RunPod fake (its own process); per-job timings forced by the request."""

    def __init__(self):
        from tests.support.runpod_fake import KEY as RUNPOD_KEY
        from tests.support.runpod_fake import FakeRunpod

        self.fake = FakeRunpod({"api_key": RUNPOD_KEY})

    def provider(self) -> Provider:
        from tests.support.runpod_fake import runpod_provider

        return runpod_provider(self.fake, "contract")

    def request(self, kind: str) -> dict:
        queue_s, run_s = {"fast": (0.02, 0.08), "slow": (0.0, 30.0), "queued": (30.0, 0.1)}[kind]
        return {"runpod_fake": {"*": {"queue_s": queue_s, "run_s": run_s}}}

    def close(self) -> None:
        self.fake.stop()


ADAPTERS = {"sim": SimHarness, "http": HttpHarness, "runpod": RunpodHarness}


@pytest.fixture(params=sorted(ADAPTERS))
def harness(request):
    h = ADAPTERS[request.param]()
    yield h
    h.close()


def test_attributes(harness):
    p = harness.provider()
    assert isinstance(p.name, str) and p.name
    assert p.billed_rate_per_s == 0.001 and p.idle_billed_seconds == 0.0
    assert isinstance(p.reports_queue_state, bool)


def test_handle_is_plain_json_that_another_instance_can_use(harness):
    p = harness.provider()
    h = p.submit(harness.request("fast"))
    assert isinstance(h, JobHandle) and h.provider == p.name and h.job_id
    assert abs(h.submitted_at - time.time()) < 5  # epoch seconds: comparable across hosts
    rebuilt = JobHandle.from_json(json.dumps(json.loads(h.to_json())))
    other = harness.provider()
    assert other.status(rebuilt) in set(JobState)
    r = other.result(rebuilt, cap_s=10)
    assert isinstance(r, AttemptResult) and r.state is JobState.COMPLETED
    assert r.provider == p.name and r.job_id == h.job_id and r.payload
    assert 0 < r.wall_ms < 10_000
    json.dumps(r.to_dict())  # results travel through Celery's json serializer


def test_result_of_a_terminal_job_returns_at_once(harness):
    p = harness.provider()
    h = p.submit(harness.request("fast"))
    p.result(h, cap_s=10)
    started = time.monotonic()
    assert p.result(h, cap_s=10).state is JobState.COMPLETED
    assert time.monotonic() - started < 0.5


def test_result_right_censors_at_the_cap_measured_from_submit(harness):
    p = harness.provider()
    h = p.submit(harness.request("slow"))
    time.sleep(0.2)
    started = time.monotonic()
    r = p.result(h, cap_s=0.5)  # 0.5 s after submit, so ~0.3 s from now
    assert r.state is JobState.TIMEOUT and r.wall_ms == 500.0
    assert time.monotonic() - started < 1.5
    assert p.status(h) is JobState.IN_PROGRESS  # left running: cancelling is the caller's call
    p.cancel(h)


def test_cancel_of_a_running_job_is_confirmed_terminal(harness):
    p = harness.provider()
    h = p.submit(harness.request("slow"))
    time.sleep(0.1)
    receipt = p.cancel(h)
    assert isinstance(receipt, CancelReceipt)
    assert receipt.provider == p.name and receipt.job_id == h.job_id
    assert receipt.evidence is Evidence.CONFIRMED_TERMINAL and not receipt.leaked
    assert receipt.terminal_status is JobState.CANCELLED
    assert receipt.cancel_sent_ms <= receipt.cancel_ack_ms <= receipt.terminal_ms
    assert receipt.reconciled_cost_usd is not None and receipt.reconciled_cost_usd > 0
    assert p.status(h) is JobState.CANCELLED
    assert p.result(h, cap_s=60).state is JobState.CANCELLED
    CancelReceipt.from_dict(json.loads(json.dumps(receipt.to_dict())))


def test_cancel_of_a_queued_job_costs_nothing(harness):
    p = harness.provider()
    h = p.submit(harness.request("queued"))
    receipt = p.cancel(h)
    assert receipt.confirmed_terminal and receipt.was_running is False
    assert receipt.reconciled_cost_usd == 0.0 and receipt.scope.value == "queued_job"
