"""Direct dispatch: a caller that finds a GPU free and nobody waiting sends the job straight to
that GPU, and the request keeps every guarantee of the queued path.

The claim's rules are checked on the real Redis with a GPU registered by hand; the rest on real
workers: a GPU worker and, where a test needs one, a coordination worker for the wait queue.
"""

from __future__ import annotations

import time

import pytest

from gpuhedge_celery.core.lease_rules import GpuInfo
from gpuhedge_celery.store.availability import drain, out_reasons, undrain
from gpuhedge_celery.store.direct import DirectClaims
from gpuhedge_celery.store.keys import Keys
from gpuhedge_celery.store.leases import LeaseStore
from gpuhedge_celery.store.pooled import PooledRecords
from gpuhedge_celery.tasks import pooled_sweep
from gpuhedge_celery.tasks.app import QUEUE_POOL
from gpuhedge_celery.tasks.pooled_direct import send_direct
from gpuhedge_celery.tasks.pooled_result import send_pooled
from gpuhedge_celery.tasks.pooled_sweep import resend_lost
from tests.support.faults import start_fault_cluster
from tests.support.fixtures_celery import broker_url_for

pytestmark = [pytest.mark.redis, pytest.mark.cluster]

POOL_ONLY = {"GPUHEDGE_COORD_QUEUES": QUEUE_POOL}


def test_a_claim_takes_only_a_free_live_gpu_and_never_overtakes_a_waiter(redis_client):
    store = LeaseStore(redis_client, f"direct{time.time_ns()}")
    k: Keys = store.keys
    every = PooledRecords(redis_client, k)
    records = every.of("p")
    claims = DirectClaims(store, every)
    store.register_gpu(GpuInfo("h1:0", "p", "h1", {"model": "a"}))
    store.register_gpu(GpuInfo("h2:0", "p", "h2", {"model": "b"}))
    store.host_heartbeat("h1", 60_000)  # h2 never heartbeats: a silent host

    def claim(request_id: str, **kwargs):
        return claims.claim(request_id, [{"x": 1}], {"pool": "p", **kwargs}, None)

    lease = claim("r1")
    assert lease is not None and lease.gpu_id == "h1:0" and lease.holder == "r1"
    assert store.current("h1:0").token == lease.token  # a real lease, fenced
    assert records.state("r1") == "handed" and records.handed_to("r1") == ("h1:0", lease.token, "")
    assert records.arguments("r1") == ([{"x": 1}], {"pool": "p"}, None)  # what a resend sends
    assert claim("r2") is None  # h1:0 held, h2:0's host silent
    store.release(lease)
    redis_client.zadd(k.waiters("p"), {"somebody-waiting": 1})
    assert claim("r3") is None  # a waiter is first
    redis_client.delete(k.waiters("p"))
    drain(store, ["h1:0"])
    assert claim("r4") is None  # drained: takes no new lease
    undrain(store, ["h1:0"])
    assert claim("r5", labels={"model": "b"}) is None  # only h2:0 matches, and it is silent
    store.host_heartbeat("h2", 60_000)
    claims._gpus.clear()
    matched = claim("r6", labels={"model": "b"})
    assert matched is not None and matched.gpu_id == "h2:0"
    assert claims.claim("r7", [{}], {"pool": "no-such-pool"}, None) is None
    assert claims.claim("r8", [{}], {"pool": 3}, None) is None  # left to the queued path's
    assert claims.claim("r9", [{}], {"pool": "p", "labels": "a=b"}, None) is None  # errors
    for request_id in ("r2", "r3", "r4", "r5", "r7", "r8", "r9"):
        assert not records.known(request_id)  # a declined claim writes nothing
    claims.undo(matched)
    assert store.current("h2:0") is None and not records.known("r6")


def test_a_claim_asked_again_after_a_lost_reply_gets_the_same_lease(redis_client):
    store = LeaseStore(redis_client, f"direct{time.time_ns()}")
    claims = DirectClaims(store, PooledRecords(redis_client, store.keys))
    for gpu in ("h1:0", "h1:1"):
        store.register_gpu(GpuInfo(gpu, "p", "h1"))
    store.host_heartbeat("h1", 60_000)
    first = claims.claim("r1", [{}], {"pool": "p"}, None)
    again = claims.claim("r1", [{}], {"pool": "p"}, None)  # its reply was lost: asked again
    assert again == first  # the same GPU, token and start, never a second GPU
    assert store.current("h1:1") is None
    sec, _ = redis_client.time()
    assert abs(first.since_ms - sec * 1000) < 2_000  # Redis's clock, not the caller's


def test_what_a_direct_send_leaves_to_the_queued_path(redis_url, redis_client, broker, request):
    """The switch, Celery options a direct send cannot honour, pooled_infer's internal
    arguments and arguments pooled_infer refuses all go to the queued path, with a free GPU
    right there for the taking."""
    from gpuhedge_celery.tasks.app import create_app
    from gpuhedge_celery.tasks.config import GlueConfig
    from gpuhedge_celery.tasks.pooled_direct import claims_for
    from gpuhedge_celery.tasks.pooled_result import records_for

    prefix = f"direct{time.time_ns()}"
    env = {"GPUHEDGE_REDIS_URL": redis_url, "GPUHEDGE_PREFIX": prefix}
    broker_url = broker_url_for(broker, request)
    if broker_url is not None:  # a store on a cluster: Celery's broker apart
        env["GPUHEDGE_BROKER_URL"] = broker_url
    store = LeaseStore(redis_client, prefix)
    store.register_gpu(GpuInfo("h1:0", "p", "h1", {"model": "a"}))
    store.host_heartbeat("h1", 60_000)
    off = create_app(GlueConfig.from_env({**env, "GPUHEDGE_POOL_DIRECT": "off"}))
    assert send_direct(off, records_for(off), "t1", ({"x": 1},), {"pool": "p"}, {}) is False
    on = create_app(GlueConfig.from_env(env))
    refused = [
        ({"pool": "p"}, {"countdown": 5}),
        ({"pool": "p", "attempt": 1}, {}),
        ({"pool": "p", "timeout_s": -5}, {}),
        ({"pool": "p", "labels": {"model": None}}, {}),
        ({"pool": "a pool"}, {}),
    ]
    for n, (kwargs, options) in enumerate(refused):
        sent = send_direct(on, records_for(on), f"t{n + 2}", ({"x": 1},), kwargs, options)
        assert sent is False, kwargs
    assert store.current("h1:0") is None  # nothing claimed
    # the control: the same GPU is there for a request a direct send takes
    claims = claims_for(on, records_for(on))
    lease = claims.claim("t9", ({"x": 1},), {"pool": "p"}, None)
    assert lease is not None and lease.gpu_id == "h1:0"
    claims.undo(lease)


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory, broker, request):
    """One GPU worker (3 s leases) and no coordination worker: a request that reaches its
    result went straight to the GPU.

    The worker's banner and heartbeat do not mean its GPU takes leases: its ``python:`` runner
    loads in the prefork child, and until then the GPU is out of the pool, so a direct claim
    declines and, with nobody to wait for a GPU, the request would sit in the queue. Ready here
    means in the pool."""
    cluster = start_fault_cluster(redis_url, tmp_path_factory.mktemp("direct"), deadline_s=30.0,
                                  coordinators=0, gpus=1, beat=False,
                                  broker_url=broker_url_for(broker, request),
                                  GPUHEDGE_VISIBILITY_TIMEOUT_S="3600")  # fmt: skip
    cluster.pool_workers = []
    try:
        wait_for(lambda: not out_reasons(cluster.store, cluster.gpu_id(0)), 60,
                 "the GPU's runner loaded (the GPU in the pool)")  # fmt: skip
    except AssertionError as e:
        reasons = out_reasons(cluster.store, cluster.gpu_id(0))
        cluster.close()
        raise AssertionError(f"{e}: out of the pool for {reasons}") from None
    yield cluster
    cluster.close()


def runs_of(cluster, request_id: str) -> int:
    from tests.support.faults import run_intervals

    runs = run_intervals(cluster.env["GPUHEDGE_TEST_RUN_LOG"])
    return sum(1 for gpu_runs in runs.values() for *_, rid in gpu_runs if rid == request_id)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.05)


@pytest.mark.celery
@pytest.mark.timeout(120)
def test_a_free_gpu_runs_the_request_with_no_coordination_worker(cluster):
    from gpuhedge_celery.tasks.pool import pooled_infer

    records = PooledRecords(cluster.client, cluster.store.keys)
    by_name = send_pooled(cluster.app, {"id": "direct-1", "duration_s": 0.1})
    out = by_name.get(timeout=30)
    assert out["output"]["id"] == "direct-1" and out["attempt"] == 0
    assert out["gpu_id"] == cluster.gpu_id(0)
    delayed = cluster.app.tasks[pooled_infer.name].delay({"id": "direct-2", "duration_s": 0.1})
    assert delayed.get(timeout=30)["output"]["id"] == "direct-2"
    mine = records.of("default")
    wait_for(lambda: not mine.known(by_name.id) and not mine.known(delayed.id), 10,
             "the records forgotten at the requests' end")  # fmt: skip
    assert runs_of(cluster, "direct-1") == 1 and runs_of(cluster, "direct-2") == 1
    assert cluster.store.current(cluster.gpu_id(0)) is None  # the GPU back in the pool


@pytest.mark.celery
@pytest.mark.timeout(120)
def test_a_busy_gpu_sends_the_next_request_to_wait_in_the_queue(cluster):
    records = PooledRecords(cluster.client, cluster.store.keys)
    first = send_pooled(cluster.app, {"id": "busy-1", "duration_s": 2.0})
    wait_for(lambda: cluster.store.current(cluster.gpu_id(0)) is not None, 10, "the GPU held")
    second = send_pooled(cluster.app, {"id": "queued-1", "duration_s": 0.1})
    assert records.of("default").state(second.id) == "sent"  # on the pool queue, not on the GPU's
    cluster.pool_workers.append(cluster.start_coordinator(**POOL_ONLY))
    assert first.get(timeout=30)["output"]["id"] == "busy-1"
    out = second.get(timeout=30)
    assert out["output"]["id"] == "queued-1" and out["started_at"] >= first.get()["started_at"]
    assert runs_of(cluster, "queued-1") == 1


@pytest.mark.celery
@pytest.mark.timeout(120)
def test_a_caller_that_dies_after_its_claim_leaves_a_request_the_sweep_sends_again(cluster):
    """Claimed and recorded, then nothing: the caller died before its message went out. The
    lease nobody renews ends (3 s here) and the reconcile pass sends the request again."""
    from gpuhedge_celery.tasks.pooled_result import PooledResult

    if not cluster.pool_workers:
        cluster.pool_workers.append(cluster.start_coordinator(**POOL_ONLY))
    wait_for(lambda: cluster.store.current(cluster.gpu_id(0)) is None, 30, "a free GPU")
    records = PooledRecords(cluster.client, cluster.store.keys)
    claims = DirectClaims(cluster.store, records)
    lease = claims.claim("died-1", [{"id": "died-1", "duration_s": 0.1}], {"pool": "default"},
                         QUEUE_POOL)  # fmt: skip
    assert lease is not None
    wait_for(lambda: cluster.store.current(lease.gpu_id) is None, 10, "the lease to end")
    step = int(pooled_sweep.MISSING_S * 1000)
    later = int(time.time() * 1000) + step + 100
    assert resend_lost(cluster.app, records, now_ms=later, leases=cluster.store) == []
    assert resend_lost(cluster.app, records, now_ms=later + step, leases=cluster.store) == [
        "died-1"
    ]
    result = PooledResult("died-1", app=cluster.app, backend=cluster.app.backend, recorded=True)
    assert result.get(timeout=30)["output"]["id"] == "died-1"
    assert runs_of(cluster, "died-1") == 1


@pytest.mark.celery
@pytest.mark.timeout(120)
def test_a_publish_that_fails_gives_the_gpu_back_and_leaves_no_record(cluster, monkeypatch):
    from kombu.exceptions import OperationalError

    from gpuhedge_celery.errors import StoreUnavailable

    wait_for(lambda: cluster.store.current(cluster.gpu_id(0)) is None, 30, "a free GPU")
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args[0])
        raise OperationalError("broker unreachable")

    monkeypatch.setattr(cluster.app, "send_task", refuse)
    with pytest.raises(StoreUnavailable) as info:  # the broker's error, as the package's
        send_pooled(cluster.app, {"id": "unsent"}, task_id="unsent-direct")
    assert isinstance(info.value.__cause__, OperationalError)
    assert calls == ["gpuhedge.gpu_run"]  # it had claimed the GPU and tried it directly
    records = PooledRecords(cluster.client, cluster.store.keys)
    assert not records.of("default").known("unsent-direct")
    assert cluster.store.current(cluster.gpu_id(0)) is None
