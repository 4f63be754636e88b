"""The pooled path's Redis steps wait out an outage instead of failing the request.

Whole-cluster outages are in tests/test_faults_redis.py and tests/test_faults_network.py; these
pin the rules each step follows: repeat once Redis answers, give up after the limit, and read a
repeated write's own answer as its own.
"""

from __future__ import annotations

import time

import pytest

from gpuhedge_celery.errors import LeaseLost, StoreUnavailable
from gpuhedge_celery.store.leases import GpuInfo, LeaseStore
from gpuhedge_celery.store.outage import through_outage
from gpuhedge_celery.tasks import gpu_steps
from gpuhedge_celery.tasks.gpu_steps import STARTED, RunningRecord, begin, finish


def flaky(failures: int, answer: object = "ok"):
    """A call that raises StoreUnavailable ``failures`` times, then answers."""
    calls = []

    def call():
        calls.append(time.monotonic())
        if len(calls) <= failures:
            raise StoreUnavailable("Redis at redis://127.0.0.1:1/0 is unreachable (test)")
        return answer

    return call, calls


def test_a_step_is_repeated_once_redis_answers_again(redis_client):
    call, calls = flaky(2)
    repeats = []
    assert through_outage(redis_client, "a step", call, on_retry=lambda: repeats.append(1)) == "ok"
    assert len(calls) == 3 and len(repeats) == 2


def test_a_step_gives_up_when_redis_stays_away_past_the_limit():
    import redis

    away = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    call, calls = flaky(100)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        through_outage(away, "a step", call, limit_s=1.0)
    assert 0.9 <= time.monotonic() - started < 5 and len(calls) == 1


def test_other_errors_are_not_repeated(redis_client):
    def refused():
        raise LeaseLost("gpu0", 3, "lease on gpu0 is gone")

    with pytest.raises(LeaseLost):
        through_outage(redis_client, "a step", refused)


def _leased(redis_client, prefix):
    store = LeaseStore(redis_client, prefix)
    store.register_gpu(GpuInfo("gpu0", "p", "h0"))
    store.host_heartbeat("h0", 60_000)
    return store, store.try_claim("gpu0", "req1")


def test_a_running_record_rewritten_after_a_lost_answer_is_ours_not_a_crash(redis_client, prefix):
    store, lease = _leased(redis_client, prefix)
    record = RunningRecord(store, lease, "req1")
    assert begin(store, lease, record) == (STARTED, False)  # first delivery
    # the same start repeated after its answer was lost
    assert begin(store, lease, record) == (STARTED, False)
    # a redelivery of the same job under the same token (its worker died running it, so it comes
    # to the worker's next process, always later than the millisecond the record names)
    time.sleep(0.005)
    next_process = LeaseStore(redis_client, prefix)
    assert begin(next_process, lease, RunningRecord(store, lease, "req1")) == (STARTED, True)


def test_a_release_repeated_after_an_outage_that_finds_the_gpu_free_counts_as_released(
    redis_client, prefix, monkeypatch
):
    store, lease = _leased(redis_client, prefix)
    real_script = gpu_steps.lua_script
    answers = []

    def script_that_loses_its_first_answer(client, name):
        script = real_script(client, name)

        def run(**kwargs):
            reply = script(**kwargs)  # Redis frees the GPU ...
            if not answers:
                answers.append("lost")
                raise StoreUnavailable("connection closed before the answer (test)")  # unheard
            return reply

        return run

    monkeypatch.setattr(gpu_steps, "lua_script", script_that_loses_its_first_answer)
    assert finish(store, lease, "req1") is True
    assert answers == ["lost"]
    assert store.current("gpu0") is None


def test_a_release_that_finds_the_lease_gone_at_the_first_try_is_a_lost_lease(redis_client, prefix):
    store, lease = _leased(redis_client, prefix)
    store.force_release("gpu0", lease.token)
    assert finish(store, lease, "req1") is False
