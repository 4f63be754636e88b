"""A pooled request's hand-off to its GPU (``Task.replace`` with ``gpu_run``) survives a publish
that fails once, and gives the GPU back when every try fails.

The failure is the one a broker connection restart caused on a worker thread: kombu's Redis
channel closed under the publish, raising ``AttributeError`` rather than a connection error.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from celery.exceptions import Ignore

from gpuhedge_celery.core.lease_rules import Lease
from gpuhedge_celery.errors import HandoffFailed
from gpuhedge_celery.tasks.app import gpu_queue
from gpuhedge_celery.tasks.pool import hand_to_gpu

CLOSED = AttributeError("'NoneType' object has no attribute 'client'")


class Replacing:
    """A task whose ``replace`` fails ``failures`` times, then hands off (raises Ignore)."""

    def __init__(self, failures: int):
        self.request = SimpleNamespace(id="req-1")
        self.failures = failures
        self.jobs: list = []

    def replace(self, job):
        self.jobs.append(job)
        if len(self.jobs) <= self.failures:
            raise CLOSED
        raise Ignore("Replaced by new task")


def lease() -> Lease:
    return Lease(gpu_id="g7", token=42, holder="req-1", pool="default", ttl_ms=30_000)


def test_a_publish_that_fails_once_is_sent_again_and_the_gpu_is_kept():
    task, gave_back = Replacing(failures=1), []
    with pytest.raises(Ignore):
        hand_to_gpu(task, {"x": 1}, lease(), 0, None, lambda: gave_back.append(1), (0.0, 0.0))
    assert len(task.jobs) == 2 and gave_back == []
    first, second = task.jobs
    assert first is not second  # replace links callbacks into the signature it is given
    assert second.options["queue"] == gpu_queue("g7")
    assert second.args[1]["token"] == 42


def test_when_every_try_fails_the_gpu_is_given_back_and_a_one_line_error_of_ours_raised():
    task, gave_back = Replacing(failures=10), []
    with pytest.raises(HandoffFailed) as failed:
        hand_to_gpu(task, {"x": 1}, lease(), 0, None, lambda: gave_back.append(1), (0.0, 0.0))
    assert len(task.jobs) == 3 and gave_back == [1]
    text = str(failed.value)
    assert "\n" not in text and "req-1" in text and "GPU g7" in text and "3 tries" in text
    assert "AttributeError" in text  # the broker's error is named, and kept as the cause
    assert failed.value.__cause__ is CLOSED
    # Celery's result backend rebuilds it as cls(*args): the same error reaches the caller
    assert str(HandoffFailed(*failed.value.args)) == text
