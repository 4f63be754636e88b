"""Reconcile with REAL GPU worker processes: each drift case is corrected by one pass."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from gpuhedge_celery.store.leases import LeaseKeeper
from gpuhedge_celery.tasks.app import TASK_POOLED_INFER, TASK_RECONCILE
from gpuhedge_celery.tasks.reconcile import reconcile_once
from tests.support.example_app import example_node, start_example_worker
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.brokers, pytest.mark.cluster]


def applied(summary, kind):
    return [a for a in summary["actions"] if a["kind"] == kind and a["applied"]]


def test_lease_held_on_an_idle_gpu_is_freed_once(celery_cluster):
    c = celery_cluster
    c.start_gpu(0)
    gpu = c.gpu_id(0)
    lease = c.store.try_claim(gpu, "holder-that-crashed")
    assert lease is not None
    summary = reconcile_once(c.app, c.store, grace_s=0)
    assert gpu in summary["answered"]
    assert [(a["gpu_id"], a["token"]) for a in applied(summary, "free")] == [(gpu, lease.token)]
    assert c.store.current(gpu) is None
    again = reconcile_once(c.app, c.store, grace_s=0)
    assert again["actions"] == [], "a second pass finds nothing to do"


def test_a_young_lease_on_an_idle_gpu_is_left_alone(celery_cluster):
    """The grace covers a job between the waiter's claim and the GPU worker's start."""
    c = celery_cluster
    c.start_gpu(0)
    gpu = c.gpu_id(0)
    lease = c.store.try_claim(gpu, "just-dispatched")
    assert reconcile_once(c.app, c.store, grace_s=30)["actions"] == []
    assert c.store.current(gpu).token == lease.token


def test_busy_gpu_without_a_lease_gets_it_restored(celery_cluster):
    c = celery_cluster
    workers = [c.start_gpu(0, wait=False), c.start_coordinator(wait=False)]
    c.wait_ready(*workers)
    gpu = c.gpu_id(0)
    result = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 4, "id": "busy"},))
    lease = wait_for(
        lambda: (
            c.client.exists(c.store.keys.running(c.store.pool_of(gpu), gpu))
            and c.store.current(gpu)
        ),
        20,
        "the job to start",
    )
    c.client.delete(
        c.store.keys.lease(c.store.pool_of(gpu), gpu)
    )  # Redis lost the lease (failover, restart, flush)
    summary = reconcile_once(c.app, c.store)
    restored = applied(summary, "restore")
    assert [(a["gpu_id"], a["token"], a["holder"]) for a in restored] == [
        (gpu, lease.token, result.id)
    ]
    now = c.store.current(gpu)
    assert (now.token, now.holder) == (lease.token, result.id)
    assert reconcile_once(c.app, c.store)["actions"] == []
    out = result.get(timeout=30)  # the job kept its lease: it renews and releases normally
    assert out["token"] == lease.token and out["attempt"] == 0
    assert c.store.current(gpu) is None


def test_dead_host_leaves_the_pool_and_its_lease_is_freed_after_the_ttl(celery_cluster):
    c = celery_cluster
    ttl_ms = 2000
    live = c.start_gpu(0, wait=False, GPUHEDGE_POOL_TTL_MS=str(ttl_ms))
    doomed = c.start_gpu(1, wait=False, GPUHEDGE_HOST_TTL_MS="1000")
    c.wait_ready(live, doomed)
    gpu = c.gpu_id(1)
    # A holder that keeps renewing although the host is gone (a partitioned or orphaned job).
    zombie = LeaseKeeper(c.store, c.store.try_claim(gpu, "orphan"), interval_s=0.2).start()
    try:
        os.killpg(doomed.pid, signal.SIGKILL)
        wait_for(lambda: gpu not in [g.gpu_id for g in c.store.gpus()], 5, "GPU 1 to leave")
        assert c.store.gpus(live_only=False), "still registered, just not live"
        first = reconcile_once(c.app, c.store)
        assert applied(first, "free") == [], "not before a whole TTL of silence"
        time.sleep(ttl_ms / 1000 + 0.2)
        second = reconcile_once(c.app, c.store)
        assert [(a["gpu_id"], a["reason"]) for a in applied(second, "free")] == [
            (gpu, "host stopped heartbeating")
        ]
        wait_for(zombie.lost.is_set, 5, "the orphan's keeper to learn its lease is lost")
        assert c.store.current(gpu) is None
    finally:
        zombie.stop()


def test_two_passes_at_once_do_no_harm(celery_cluster):
    c = celery_cluster
    c.start_gpu(0)
    gpu = c.gpu_id(0)
    lease = c.store.try_claim(gpu, "crashed")
    summaries = []
    barrier = threading.Barrier(2)

    def one_pass():
        barrier.wait()
        summaries.append(reconcile_once(c.app, c.store, grace_s=0))

    threads = [threading.Thread(target=one_pass) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(summaries) == 2
    frees = [a for s in summaries if "actions" in s for a in applied(s, "free")]
    assert [(a["gpu_id"], a["token"]) for a in frees] == [(gpu, lease.token)], "freed once"
    assert c.store.current(gpu) is None
    new = c.store.try_claim(gpu, "next")
    assert new is not None and new.token > lease.token


def test_beat_task_runs_a_pass_on_a_worker(celery_cluster):
    c = celery_cluster
    workers = [c.start_gpu(0, wait=False), c.start_coordinator(wait=False)]
    c.wait_ready(*workers)
    gpu = c.gpu_id(0)
    c.store.try_claim(gpu, "crashed")
    c.client.set(c.store.keys.reconcile_lock(), "x", px=1)  # an expired lock does not block
    time.sleep(0.01)
    summary = c.app.send_task(TASK_RECONCILE, kwargs={}).get(timeout=30)
    assert gpu in summary["answered"]
    assert c.store.current(gpu) is not None, "the default grace (10 s) protects a new lease"


def test_beat_schedules_reconcile_and_it_corrects_drift(celery_cluster):
    """The full loop: celery beat -> gpuhedge.reconcile on a coordinator -> a stray lease freed."""
    c = celery_cluster
    fast = {"GPUHEDGE_RECONCILE_INTERVAL_S": "1", "GPUHEDGE_RECONCILE_GRACE_S": "0"}
    workers = [c.start_gpu(0, wait=False), c.start_coordinator(wait=False, **fast)]
    c.wait_ready(*workers)
    gpu = c.gpu_id(0)
    assert c.store.try_claim(gpu, "crashed") is not None
    c.start_beat(**fast)
    wait_for(lambda: c.store.current(gpu) is None, 30, "beat's reconcile to free the lease")


def test_a_foreign_apps_worker_on_the_same_broker_never_sees_the_command(celery_cluster):
    """The existing-app example's worker (a plain Celery app, no gpuhedge import) shares the
    broker: a reconcile pass asks the GPU workers only, so it logs no pidbox error."""
    c = celery_cluster
    c.start_gpu(0)
    gpu = c.gpu_id(0)
    glue = c.app.gpuhedge_config  # results on the broker's Redis beside a Redis Cluster store
    env = {**os.environ, "BROKER_URL": glue.broker, "RESULT_BACKEND": glue.results_url}
    if glue.broker_kind == "redis":  # on Redis the cluster's broker keys carry its prefix
        env["BROKER_KEYPREFIX"] = f"{c.prefix}:"
    log = c.tmp_path / "foreign.log"
    foreign = start_example_worker(env, log)
    try:
        # The foreign worker is on this broker's control channel: it answers a ping.
        assert c.app.control.ping(destination=[example_node()], timeout=5.0)
        lease = c.store.try_claim(gpu, "holder-that-crashed")
        summary = reconcile_once(c.app, c.store, grace_s=0)
        assert gpu in summary["answered"]
        assert [(a["gpu_id"], a["token"]) for a in applied(summary, "free")] == [(gpu, lease.token)]
        # Control messages are handled in order: once this ping is answered, anything the
        # pass sent the foreign worker has been handled (and any error logged).
        assert c.app.control.ping(destination=[example_node()], timeout=5.0)
        text = log.read_text(errors="replace")
        assert "pidbox command error" not in text and "gpuhedge_gpus" not in text, text
    finally:
        os.killpg(foreign.pid, signal.SIGKILL)
        foreign.wait(10)


def test_no_registered_gpu_means_no_control_message_at_all(celery_cluster, monkeypatch):
    """An empty destination would mean "every worker": with no GPU registered, nothing is sent."""
    c = celery_cluster
    sent = []
    monkeypatch.setattr(c.app.control, "broadcast", lambda *a, **kw: sent.append((a, kw)))
    summary = reconcile_once(c.app, c.store, grace_s=0)
    assert summary["answered"] == [] and summary["gpus"] == 0
    assert sent == []


def test_stranded_jobs_of_dead_gpus_go_back_to_waiting_and_foreign_messages_stay(celery_cluster):
    """Reconcile drains a dead GPU's queue through the broker (Redis or RabbitMQ): a ``gpu_run``
    goes back to waiting under its own id; a message it does not understand stays where it was;
    a dead GPU whose queue was never declared (RabbitMQ answers 404) is no error."""
    from kombu import Queue

    from gpuhedge_celery.store.leases import GpuInfo
    from gpuhedge_celery.tasks.app import TASK_GPU_RUN, gpu_queue

    c = celery_cluster
    dead_host = f"{c.prefix}-deadhost"
    never, foreign, stranded = (f"{dead_host}:{i}" for i in range(3))
    for gpu in (never, foreign, stranded):
        c.store.register_gpu(GpuInfo(gpu, "default", dead_host))
    lease = {"gpu_id": stranded, "pool": "default", "token": 1, "holder": "x", "ttl_ms": 1000}
    job = c.app.send_task(TASK_GPU_RUN, ({"id": "stranded"}, lease), queue=gpu_queue(stranded))
    other = c.app.send_task("tests.not_a_gpu_job", (1,), queue=gpu_queue(foreign))

    summary = reconcile_once(c.app, c.store, timeout_s=0.2)
    assert summary["rescued"] == [job.id]
    assert reconcile_once(c.app, c.store, timeout_s=0.2)["rescued"] == []  # nothing twice
    with c.app.connection_for_write() as conn:

        def take(queue_name):
            return Queue(queue_name, channel=conn.default_channel).get(no_ack=True)

        assert take(gpu_queue(stranded)) is None
        left = take(gpu_queue(foreign))
        assert left is not None and left.headers["id"] == other.id
        back = take("gpuhedge.pool")  # no coordinator runs here: the rescued request waits
        assert back is not None and back.headers["id"] == job.id
        assert back.headers["task"] == TASK_POOLED_INFER
        args, kwargs, _ = back.decode()
        assert args == [{"id": "stranded"}] and kwargs["attempt"] == 1
