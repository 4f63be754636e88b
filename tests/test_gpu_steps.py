"""The GPU job's start and finish scripts on the real Redis: what each answers and writes,
that repeating either after a lost reply changes nothing, that the start checks the lease's
holder as well as its token, and that of two deliveries starting at once only one runs."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

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
    redis_client.set(stop_key(store, "p", "job-1"), "1")
    assert begin(store, lease, running) == (STOPPED, False)
    assert redis_client.get(running.key) is None  # a stopped job writes nothing
    redis_client.delete(stop_key(store, "p", "job-1"))
    assert begin(store, lease, running) == (STARTED, False)
    assert redis_client.get(running.key) == running.value
    assert store.accepted_token("h:0") == lease.token
    assert begin(store, lease, running) == (STARTED, False)  # repeated after a lost reply
    # another delivery under the same token in this process: its mark refuses it
    again = RunningRecord(store, lease, "job-1")
    again.value = running.value.rsplit("|", 1)[0] + "|1"  # written at another moment
    with pytest.raises(StaleToken, match="ran other work"):
        begin(store, lease, again)
    assert store.current("h:0").holder == "job-1"  # the running job's lease is left alone
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


def test_a_job_starts_only_under_its_own_holder(store, redis_client):
    lease = store.try_claim("h:0", "job-1")
    # A failover issued the same number again, to another holder.
    other = replace(lease, holder="job-2")
    running = RunningRecord(store, other, "job-2")
    with pytest.raises(LeaseLost, match="another lease"):
        begin(store, other, running)
    assert redis_client.get(running.key) is None  # nothing written
    assert store.accepted_token("h:0") == 0 and store.mark("h:0") == 0
    assert store.current("h:0").holder == "job-1"  # not freed: it is job-1's to run
    with pytest.raises(LeaseLost, match="another lease"):
        store.check_fence("h:0", lease.token, "d-2", holder="job-2")
    assert store.accepted_token("h:0") == 0
    assert begin(store, lease, RunningRecord(store, lease, "job-1"))[0] == STARTED
    assert finish(store, lease, "job-1") is True


def test_the_fence_script_without_a_holder_checks_the_token_alone(store, redis_client):
    lease = store.try_claim("h:0", "job-1")
    k = store.keys
    keys = [k.lease("p", "h:0"), k.accepted("p", "h:0")]
    check = store.scripts.check_fence
    assert check(keys=keys, args=[lease.token]) == [1, lease.token]
    assert check(keys=keys, args=[lease.token, "", ""]) == [1, lease.token]
    assert check(keys=keys, args=[lease.token, "", "job-2"]) == [-2, 0]
    assert check(keys=keys, args=[lease.token, "", "job-1"]) == [1, lease.token]
    store.check_fence("h:0", lease.token)  # LeaseStore's callers without a holder
    store.check_fence("h:0", lease.token, holder="job-1")


def slowed_fence_script(store: LeaseStore, monkeypatch) -> None:
    """Make the first caller of the fence script wait (up to 0.5 s) for a second one to reach
    it too, so two unserialised checks overlap; a gate that serialises them only costs time."""
    real = store.scripts.check_fence
    second = threading.Event()
    calls = []

    def slowed(**kwargs):
        calls.append(1)
        if len(calls) == 1:
            second.wait(0.5)
        else:
            second.set()
        return real(**kwargs)

    monkeypatch.setattr(store.scripts, "check_fence", slowed)


def run_together(*calls) -> list[object]:
    """Run ``calls`` in threads at once; each one's return value or exception."""
    outcomes: list[object] = [None] * len(calls)

    def run(i, call):
        try:
            outcomes[i] = call()
        except Exception as e:  # noqa: BLE001 - the outcome under test
            outcomes[i] = e

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return outcomes


def test_of_two_deliveries_starting_at_once_one_runs(store, redis_client, monkeypatch):
    lease = store.try_claim("h:0", "job-1")
    slowed_fence_script(store, monkeypatch)
    first, second = RunningRecord(store, lease, "job-1"), RunningRecord(store, lease, "job-1")
    second.value = first.value.rsplit("|", 1)[0] + "|1"  # another delivery of the same job
    outcomes = run_together(lambda: begin(store, lease, first), lambda: begin(store, lease, second))
    started = [o for o in outcomes if o == (STARTED, False)]
    refused = [o for o in outcomes if isinstance(o, StaleToken)]
    assert len(started) == 1 and len(refused) == 1, outcomes
    winner = first if outcomes[0] == (STARTED, False) else second
    assert redis_client.get(winner.key) == winner.value
    assert store.current("h:0").holder == "job-1"  # the running delivery keeps its lease


def test_of_two_checks_with_one_token_at_once_one_passes(store, monkeypatch):
    lease = store.try_claim("h:0", "job-1")
    slowed_fence_script(store, monkeypatch)
    outcomes = run_together(
        lambda: store.check_fence("h:0", lease.token, "d-1", lease.holder),
        lambda: store.check_fence("h:0", lease.token, "d-2", lease.holder),
    )
    assert sorted(type(o).__name__ for o in outcomes) == ["NoneType", "StaleToken"], outcomes


def test_one_gpu_checking_does_not_hold_up_another(store):
    store.register_gpu(GpuInfo("h:1", "p", "h"))
    lease = store.try_claim("h:1", "job-1")
    with store.fence_gate("h:0"):  # a check on h:0 in progress
        [outcome] = run_together(lambda: store.check_fence("h:1", lease.token, "d-1"))
    assert outcome is None and store.mark("h:1") == lease.token
