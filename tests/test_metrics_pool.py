"""What the GPU pool counts, on real Celery workers: leases lost, pool waits given up, and the
reconcile pass's corrections.

One cluster for the module: a prefork GPU worker (its job runs in the child, counted in
multiprocess mode) and a coordination worker (threads pool: the pooled waits), each with its
own ``GPUHEDGE_METRICS_PORT``, scraped over HTTP and parsed with prometheus_client's parser.
The reconcile pass runs in this process (as beat's task would on a coordinator), so its
corrections are read from this process's registry. ``GPUHEDGE_MAX_ATTEMPTS=1``: a request
that loses its lease fails at once instead of waiting again, so nothing is left queued.
Tests compare counters before and after what they do, so their order does not matter.
"""

from __future__ import annotations

import uuid

import pytest

from gpuhedge_celery.errors import AcquireTimeout, LeaseLost
from gpuhedge_celery.metrics import record
from gpuhedge_celery.tasks.app import TASK_GPU_RUN, TASK_POOLED_INFER, gpu_queue
from gpuhedge_celery.tasks.cancel import cancel_pooled, running_on
from gpuhedge_celery.tasks.reconcile import reconcile_once
from tests.support.fixtures_celery import CeleryCluster
from tests.support.fixtures_races import REPO
from tests.support.prometheus_server import sample, scrape, wait_for_endpoint
from tests.support.redis_server import free_port
from tests.support.waiting import wait_for
from tests.test_metrics_record import Delta

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.timeout(120)]

LOST = "gpuhedge_leases_lost_total"
CORRECTIONS = "gpuhedge_reconcile_corrections_total"
GAVE_UP = "gpuhedge_pool_wait_timeouts_total"


class PoolCluster:
    def __init__(self, redis_url: str, tmp, broker_url: str | None = None) -> None:
        prefix = f"t{uuid.uuid4().hex[:10]}"
        self.cluster = c = CeleryCluster(redis_url, prefix, tmp, broker_url)
        c.env.update({"PYTHONPATH": str(REPO), "GPUHEDGE_METRICS_ADDR": "127.0.0.1",
                      "GPUHEDGE_MAX_ATTEMPTS": "1"})  # fmt: skip
        self.ports = {"coord": free_port(), "gpu0": free_port()}
        c.wait_ready(
            c.start_coordinator(wait=False, GPUHEDGE_METRICS_PORT=str(self.ports["coord"])),
            c.start_gpu(0, wait=False, GPUHEDGE_METRICS_PORT=str(self.ports["gpu0"]),
                        PROMETHEUS_MULTIPROC_DIR=str(tmp / "prom-gpu0")),
        )  # fmt: skip
        for port in self.ports.values():
            wait_for_endpoint(port)
        self.store, self.app, self.gpu = c.store, c.app, c.gpu_id(0)

    def grew(self, worker: str, before, name: str, **labels: str) -> float:
        return sample(scrape(self.ports[worker]), name, **labels) - sample(before, name, **labels)

    def run_under(self, lease, seconds: float, tag: str):
        """``gpu_run`` sent straight to the GPU's queue under ``lease``; returns once running."""
        request = {"duration_s": seconds, "id": tag}
        res = self.app.send_task(TASK_GPU_RUN, (request, lease.to_dict()),
                                 queue=gpu_queue(self.gpu))  # fmt: skip
        wait_for(lambda: running_on(self.store, "default", res.id), 20, f"{tag} to start")
        return res


@pytest.fixture(scope="module")
def pc(redis_url, tmp_path_factory, broker, request):
    from gpuhedge_celery.store.connection import redis_from_url
    from gpuhedge_celery.store.listener import enable_notifications
    from tests.support.fixtures_celery import broker_url_for

    enable_notifications(redis_from_url(redis_url))
    tmp = tmp_path_factory.mktemp("metrics-pool")
    cluster = PoolCluster(redis_url, tmp, broker_url_for(broker, request))
    yield cluster
    cluster.cluster.close()
    client = redis_from_url(redis_url)
    keys = list(client.scan_iter(f"{cluster.cluster.prefix}:*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture
def free_gpu(pc):
    """The GPU free before and after each test (a failed test may leave a lease behind)."""
    pc.store.force_release(pc.gpu)
    yield pc
    running = pc.store.keys.running(pc.store.pool_of(pc.gpu), pc.gpu)
    wait_for(lambda: not pc.cluster.client.exists(running), 20, "the GPU to be idle")
    pc.store.force_release(pc.gpu)


def test_a_stale_token_refused_at_the_fence_counts_a_lost_lease(free_gpu):
    pc = free_gpu
    old = pc.store.try_claim(pc.gpu, "old-holder")
    pc.store.release(old)
    newer = pc.store.try_claim(pc.gpu, "newer-holder")
    pc.store.check_fence(pc.gpu, newer.token)  # the GPU has accepted a newer token
    pc.store.release(newer)
    before = scrape(pc.ports["gpu0"])
    stale = pc.app.send_task(TASK_GPU_RUN, ({"id": "stale"}, old.to_dict()),
                             queue=gpu_queue(pc.gpu))  # fmt: skip
    with pytest.raises(LeaseLost, match="refused"):
        stale.get(timeout=30)
    assert pc.grew("gpu0", before, LOST, pool="default", stage="fence") == 1
    assert pc.grew("gpu0", before, LOST, pool="default", stage="running") == 0


def test_a_lease_taken_over_while_the_job_runs_counts_a_lost_lease(free_gpu):
    pc = free_gpu
    lease = pc.store.try_claim(pc.gpu, "victim-holder", ttl_ms=1500)  # renewed every 0.5 s
    before = scrape(pc.ports["gpu0"])
    res = pc.run_under(lease, 10, "victim")
    assert pc.store.force_release(pc.gpu, lease.token)
    intruder = pc.store.try_claim(pc.gpu, "intruder", ttl_ms=60_000)
    try:
        with pytest.raises(LeaseLost, match="gave up after 1 attempt"):
            res.get(timeout=30)  # stopped at its next renewal, long before its 10 s
    finally:
        pc.store.release(intruder)
    assert pc.grew("gpu0", before, LOST, pool="default", stage="running") == 1


def test_a_conflict_is_reported_and_a_lease_gone_at_release_is_counted(free_gpu):
    pc = free_gpu
    lease = pc.store.try_claim(pc.gpu, "job-holder", ttl_ms=60_000)  # next renewal: in 20 s
    before = scrape(pc.ports["gpu0"])
    res = pc.run_under(lease, 3, "conflicted")
    assert pc.store.force_release(pc.gpu, lease.token)
    intruder = pc.store.try_claim(pc.gpu, "intruder", ttl_ms=60_000)
    try:
        d = Delta()
        summary = reconcile_once(pc.app, pc.store, timeout_s=1.0)
        conflicts = [a for a in summary["actions"] if a["kind"] == "conflict"]
        assert [(a["token"], a["applied"]) for a in conflicts] == [(intruder.token, False)]
        assert d.of(CORRECTIONS, kind="conflict") == 1
        assert d.of(CORRECTIONS, kind="free") == d.of(CORRECTIONS, kind="restore") == 0
        with pytest.raises(LeaseLost, match="lost before release"):
            res.get(timeout=30)  # it ran to its end, then found the lease gone
    finally:
        pc.store.release(intruder)
    assert pc.grew("gpu0", before, LOST, pool="default", stage="release") == 1


def test_reconcile_counts_a_lease_it_restores_and_one_it_frees(free_gpu):
    pc = free_gpu
    assert record.active()
    lease = pc.store.try_claim(pc.gpu, "job-holder", ttl_ms=60_000)
    res = pc.run_under(lease, 6, "restored")  # outlasts the reconcile's broadcast
    pc.cluster.client.delete(
        pc.store.keys.lease(pc.store.pool_of(pc.gpu), pc.gpu)
    )  # Redis lost the lease
    d = Delta()
    # the GPU worker's answer to the broadcast may take over 1 s on a loaded machine
    summary = reconcile_once(pc.app, pc.store, timeout_s=2.5)
    assert [a["kind"] for a in summary["actions"] if a["applied"]] == ["restore"]
    assert d.of(CORRECTIONS, kind="restore") == 1
    assert res.get(timeout=30)["token"] == lease.token  # it kept its lease to the end

    stray = pc.store.try_claim(pc.gpu, "crashed-holder")  # held on an idle GPU
    d = Delta()
    summary = reconcile_once(pc.app, pc.store, timeout_s=2.5, grace_s=0)
    assert [(a["kind"], a["token"]) for a in summary["actions"]] == [("free", stray.token)]
    assert d.of(CORRECTIONS, kind="free") == 1
    assert d.of(CORRECTIONS, kind="restore") == 0


def test_pooled_requests_that_stop_waiting_are_counted(free_gpu):
    pc = free_gpu
    hold = pc.store.try_claim(pc.gpu, "busy-elsewhere", ttl_ms=60_000)
    before = scrape(pc.ports["coord"])
    try:
        timed_out = pc.app.send_task(TASK_POOLED_INFER, ({"id": "impatient"},),
                                     {"pool": "default", "timeout_s": 0.5})  # fmt: skip
        with pytest.raises(AcquireTimeout):
            timed_out.get(timeout=30)
        cancelled = pc.app.send_task(TASK_POOLED_INFER, ({"id": "cancelled"},),
                                     {"pool": "default", "timeout_s": 60})  # fmt: skip
        wait_for(lambda: cancelled.id in pc.store.queue("default"), 20, "it to queue")
        cancel_pooled(pc.store, "default", cancelled.id)
        with pytest.raises(AcquireTimeout, match="cancelled"):
            cancelled.get(timeout=30)
    finally:
        pc.store.release(hold)
    assert pc.grew("coord", before, GAVE_UP, pool="default") == 2
    assert pc.grew("coord", before, "gpuhedge_pool_wait_seconds_count", pool="default") == 0


def test_a_request_sent_straight_to_a_free_gpu_counts_a_wait_of_zero(free_gpu):
    """Direct dispatch (``tasks/pooled_direct.py``) skips the coordinator's wait: the GPU
    worker counts the request's wait as 0, once, so the histogram counts every request and
    not only those that queued."""
    from gpuhedge_celery.tasks.pooled_result import send_pooled

    pc = free_gpu
    wait = "gpuhedge_pool_wait_seconds"
    before = {worker: scrape(port) for worker, port in pc.ports.items()}
    res = send_pooled(pc.app, {"id": "direct", "duration_s": 0.1}, pool="default")
    assert res.get(timeout=30)["gpu_id"] == pc.gpu
    assert pc.grew("coord", before["coord"], f"{wait}_count", pool="default") == 0  # no wait ran
    assert pc.grew("gpu0", before["gpu0"], f"{wait}_count", pool="default") == 1
    assert pc.grew("gpu0", before["gpu0"], f"{wait}_bucket", pool="default", le="0.001") == 1
