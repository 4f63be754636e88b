"""A warm shutdown (SIGTERM) stops an idle worker at once, on either broker, with REAL workers.

Celery's SIGTERM handler only sets a flag that the worker reads when its event loop next wakes;
on RabbitMQ with no message coming, kombu sleeps until its next timer, up to 10 s (a worker took
8 s to stop). The worker wakes its loop when the shutdown begins (``tasks/signals.py``).
"""

from __future__ import annotations

import signal
import time

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.brokers, pytest.mark.timeout(120)]


@pytest.mark.parametrize("role", ["coordinator", "solo GPU worker"])
def test_sigterm_stops_an_idle_worker_within_three_seconds(celery_cluster, role):
    c = celery_cluster
    if role == "coordinator":
        worker = c.start_coordinator()
    else:
        worker = c.start_gpu(5, argv=("--pool", "solo"))
    time.sleep(1.5)  # idle: the event loop is asleep until its next timer
    started = time.monotonic()
    worker.kill(signal.SIGTERM)  # the main process only, as systemd and Kubernetes stop it
    worker.process.wait(30)
    took = time.monotonic() - started
    assert took < 3.0, f"the {role} took {took:.1f} s to stop"  # (kombu asleep: 8-10 s)
