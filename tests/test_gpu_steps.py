"""The GPU job's start and finish scripts on the real Redis: what each answers and writes,
and that repeating either after a lost reply changes nothing."""

from __future__ import annotations

import time

import pytest

from gpuhedge_celery.core.lease_rules import GpuInfo
from gpuhedge_celery.errors import LeaseLost, StaleToken
from gpuhedge_celery.store.leases import LeaseStore
from gpuhedge_celery.tasks.cancel import stop_key
from gpuhedge_celery.tasks.gpu_steps import STARTED, STOPPED, RunningRecord, begin, finish

pytestmark = [pytest.mark.redis]


@pytest.fixture
def store(redis_client):
    store = LeaseStore(redis_client, f"steps{time.time_ns()}")
    store.register_gpu(GpuInfo("h:0", "p", "h"))
    store.host_heartbeat("h", 60_000)
    return store


def test_a_job_starts_only_unstopped_and_under_its_current_token(store, redis_client):
    lease = store.try_claim("h:0", "job-1")
    running = RunningRecord(store, lease, "job-1")
    redis_client.set(stop_key(store, "job-1"), "1")
    assert begin(store, lease, running) == (STOPPED, False)
    assert redis_client.get(running.key) is None  # a stopped job writes nothing
    redis_client.delete(stop_key(store, "job-1"))
    assert begin(store, lease, running) == (STARTED, False)
    assert redis_client.get(running.key) == running.value
    assert store.accepted_token("h:0") == lease.token
    assert begin(store, lease, running) == (STARTED, False)  # repeated after a lost reply
    # another delivery under the same token in this process: its mark refuses it
    again = RunningRecord(store, lease, "job-1")
    again.value = running.value.rsplit("|", 1)[0] + "|1"  # written at another moment
    with pytest.raises(StaleToken, match="ran other work"):
        begin(store, lease, again)
    # a delivery in the worker's next process after this one died running the job: it crashed
    next_process = LeaseStore(redis_client, store.prefix)
    assert begin(next_process, lease, again) == (STARTED, True)
    assert finish(store, lease, "job-1") is True
    assert store.current("h:0") is None and redis_client.get(running.key) is None


def test_a_refused_fence_writes_no_running_record(store, redis_client):
    old = store.try_claim("h:0", "job-old")
    store.release(old)
    new = store.try_claim("h:0", "job-new")
    running_new = RunningRecord(store, new, "job-new")
    assert begin(store, new, running_new)[0] == STARTED
    stale = RunningRecord(store, old, "job-old")
    with pytest.raises(StaleToken):  # a newer token was accepted
        begin(store, old, stale)
    assert redis_client.get(stale.key) == running_new.value  # the running job's, untouched
    assert finish(store, new, "job-new") is True
    with pytest.raises(LeaseLost):  # no lease at all
        begin(store, new, running_new)
    other = store.try_claim("h:0", "job-other")
    with pytest.raises(LeaseLost):  # the lease carries another token
        begin(store, new, running_new)
    assert finish(store, new, "job-new") is False  # not ours to release
    assert store.current("h:0").token == other.token


def test_finish_clears_only_its_own_running_record(store, redis_client):
    lease = store.try_claim("h:0", "job-1")
    running = RunningRecord(store, lease, "job-1")
    begin(store, lease, running)
    redis_client.set(running.key, "job-2|99|1")  # another job's record (a later dispatch)
    assert finish(store, lease, "job-1") is True
    assert redis_client.get(running.key) == "job-2|99|1"
    assert store.current("h:0") is None
