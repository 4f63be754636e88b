"""A pooled request is never lost silently: its record lets a lost message be sent again, and a
request Redis forgot entirely fails its caller explicitly.

The losses themselves are made by hand, on real workers and a real Redis broker, so each test
is exact: the message is taken out of the broker's pool queue (what ``appendfsync everysec``
losing its last second, or a worker killed between kombu's pop and its unacked record, does),
and, for the second, the record with it.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout

from gpuhedge_celery.errors import RequestLost
from gpuhedge_celery.store.connection import redis_from_url
from gpuhedge_celery.store.listener import servers
from gpuhedge_celery.store.pooled import PooledRecords
from gpuhedge_celery.tasks import pooled_result, pooled_sweep
from gpuhedge_celery.tasks.app import QUEUE_POOL
from gpuhedge_celery.tasks.pooled_result import send_pooled
from gpuhedge_celery.tasks.pooled_sweep import resend_lost
from tests.support.faults import start_fault_cluster

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.timeout(180), pytest.mark.cluster]

RACE_QUEUES = {"GPUHEDGE_COORD_QUEUES": "gpuhedge.coord,gpuhedge.attempts"}
POOL_ONLY = {"GPUHEDGE_COORD_QUEUES": QUEUE_POOL}


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory, broker, request):
    """A GPU worker and a coordinator that does not take pooled requests: they stay queued
    until a test starts a pool worker (direct dispatch off: these losses are the queued
    path's; tests/test_pool_direct.py has the direct path's)."""
    # the Redis broker's default visibility timeout: a dead worker's messages come back only
    # after an hour, so whatever comes back sooner came back through the sweep
    from tests.support.fixtures_celery import broker_url_for

    cluster = start_fault_cluster(redis_url, tmp_path_factory.mktemp("lost"), deadline_s=30.0,
                                  broker_url=broker_url_for(broker, request),
                                  coordinators=0, gpus=1, beat=False,
                                  GPUHEDGE_VISIBILITY_TIMEOUT_S="3600",
                                  GPUHEDGE_POOL_DIRECT="off")  # fmt: skip
    cluster.start_coordinator(**RACE_QUEUES)
    # the broker's Redis: the store's, or a plain one beside a Redis Cluster store
    cluster.broker_client = redis_from_url(cluster.config.broker, decode_responses=True)
    yield cluster
    cluster.broker_client.close()
    cluster.close()


def start_pool_worker(cluster) -> None:
    cluster.pool_workers = [*getattr(cluster, "pool_workers", []),
                            cluster.start_coordinator(**POOL_ONLY)]  # fmt: skip


def stop_pool_workers(cluster) -> None:
    for worker in getattr(cluster, "pool_workers", []):
        worker.stop()
    cluster.pool_workers = []


def records(cluster) -> PooledRecords:
    return PooledRecords(cluster.client, cluster.store.keys)


def queued(cluster) -> list[str]:
    """The raw messages on the pool queue of the cluster's (Redis) broker."""
    return cluster.broker_client.lrange(f"{cluster.prefix}:{QUEUE_POOL}", 0, -1)


def lose_message(cluster, request_id: str) -> None:
    """Take the request's message out of the broker, as a crash would."""
    [raw] = [m for m in queued(cluster) if request_id in m]
    assert cluster.broker_client.lrem(f"{cluster.prefix}:{QUEUE_POOL}", 1, raw) == 1


def live_process(client, keys, process_id: str):
    """What a live waiting process has: a fresh heartbeat and its liveness channel subscribed
    (``store/liveness.py``), on every server as the listener subscribes it (each primary of a
    Redis Cluster); returns the subscriptions (close them: the process is gone)."""
    sec, usec = client.time()
    client.zadd(keys.procs("p"), {process_id: sec * 1000 + usec // 1000})
    subscriptions = ExitStack()
    for server in servers(client):
        sub = server.pubsub()
        sub.subscribe(keys.proc_channel(process_id))
        sub.get_message(timeout=1)
        subscriptions.callback(sub.close)
    return subscriptions


def test_records_follow_a_request_from_send_to_end(redis_url):
    from gpuhedge_celery.errors import ConfigError
    from gpuhedge_celery.store.keys import Keys
    from gpuhedge_celery.store.pooled import DUPLICATE, HANDED, SUPERSEDED, TAKEN, UNRECORDED

    client = redis_from_url(redis_url, decode_responses=True)
    keys = Keys(f"rec{time.time_ns()}")
    r = PooledRecords(client, keys).of("p")
    r.sent("a", [{"x": 1}], {"pool": "p"}, 1_000, "q1")
    r.sent("b", [{"x": 2}], {}, 5_000)
    assert r.untaken_since(2_000) == ["a"] and r.untaken_since(9_000) == ["a", "b"]
    assert r.arguments("a") == ([{"x": 1}], {"pool": "p"}, "q1") and r.state("a") == "sent"
    assert r.missing_since("a", 7_000) == 7_000 and r.missing_since("a", 9_000) == 7_000
    p1, p2 = live_process(client, keys, "p1"), live_process(client, keys, "p2")
    assert r.take("a", "p1", "d1") == TAKEN and r.untaken_since(9_000) == ["b"]
    assert r.take("a", "p2", "d2") == DUPLICATE  # p1 is alive and has it
    assert r.take("a", "p1", "d1") == TAKEN  # the same delivery again (a lost answer)
    assert r.take("a", "p1", "d9") == DUPLICATE  # another delivery in the same process
    # sent back to waiting after its GPU was lost: a higher attempt always takes it
    assert r.take("a", "p2", "d3", attempt=1) == TAKEN
    assert r.handoff("a", "d1") == SUPERSEDED and r.handoff("a", "d3") == HANDED
    assert r.handoff("a", "d3") == HANDED  # its own handoff sent again (the reply was lost)
    assert r.handoff("a", "d1") == SUPERSEDED
    assert r.take("a", "p1", "d4", attempt=1) == HANDED  # a late copy of a handed request
    assert r.handed_to("a") == ("", 0, "p2")  # handed without a lease named (older callers)
    assert r.handed_before(10**13) == ["a"]
    assert r.take("a", "p1", "d5", attempt=2) == TAKEN
    assert r.handed_before(10**13) == [] and r.handed_to("a") is None  # taken again
    assert r.handoff("a", "d5", "gpu-3", 41) == HANDED and r.handed_to("a") == ("gpu-3", 41, "p1")
    assert r.dead_takers(0) == []  # p1 and p2 alive
    # a taker that dies: its subscription closes with its socket
    assert r.take("b", "p2", "e1") == TAKEN
    p2.close()
    assert r.dead_takers(0) == [("b", "p2")] and r.dead_takers(60_000) == []  # too recent
    assert r.requeue("b", "taken", "p2", 20_000) == ([{"x": 2}], {}, None)
    assert r.state("b") == "sent" and r.taker("b") == "" and r.untaken_since(20_000) == ["b"]
    assert r.requeue("b", "taken", "p2", 21_000) is None  # changed since the sweep saw it
    assert r.take("b", "p1", "e2") == TAKEN  # the copy sent again is taken as new
    assert r.take("never-recorded", "p1", "x") == UNRECORDED
    assert not r.known("never-recorded")
    assert client.pttl(r.record_key("a")) > 0
    client.pexpire(r.record_key("b"), 5_000)  # a wait near the end of the record's TTL
    assert r.take("b", "p1", "e2") == TAKEN and client.pttl(r.record_key("b")) > 5_000
    client.pexpire(r.record_key("b"), 5_000)
    assert r.handoff("b", "e2") == HANDED and client.pttl(r.record_key("b")) > 5_000
    r.forget("a")
    assert not r.known("a") and client.zscore(r.missing_key, "a") is None
    assert client.zscore(r.handed_key, "a") is None
    assert client.zscore(r.taken_key, "a") is None
    with pytest.raises(ConfigError, match="not JSON-serialisable"):
        r.sent("c", [object()], {}, 1)
    p1.close()


def test_a_message_lost_before_any_worker_took_it_is_sent_again(cluster):
    result = send_pooled(cluster.app, {"id": "lost-1", "duration_s": 0.2})
    lose_message(cluster, result.id)
    rec = records(cluster)
    now = int(time.time() * 1000)
    later = now + int(pooled_sweep.STALE_S * 1000) + 100
    # first sweep past the stale age: missing is only noted (a worker may be moving it)
    assert resend_lost(cluster.app, rec, now_ms=later) == []
    assert resend_lost(cluster.app, rec, now_ms=later + 500) == []  # not yet MISSING_S apart
    assert resend_lost(cluster.app, rec, now_ms=later + int(pooled_sweep.MISSING_S * 1000)) == [
        result.id
    ]
    assert any(result.id in m for m in queued(cluster))  # sent again, same task id
    start_pool_worker(cluster)
    out = result.get(timeout=60)
    assert out["output"]["id"] == "lost-1"
    # its end deleted the record: nothing left for a sweep, nothing for the caller to check
    deadline = time.monotonic() + 10
    while rec.of("default").known(result.id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rec.of("default").known(result.id)
    assert rec.of("default").untaken_since(later + 10_000) == []


def test_a_request_still_queued_is_never_sent_twice(cluster):
    # no pool worker consumes: the message waits in the broker (a backlog), it is not lost
    stop_pool_workers(cluster)
    result = send_pooled(cluster.app, {"id": "queued-1", "duration_s": 0.1})
    rec = records(cluster)
    later = int(time.time() * 1000) + int(pooled_sweep.STALE_S * 1000) + 100
    for step in range(3):
        assert resend_lost(cluster.app, rec, now_ms=later + step * 3_000) == []
    assert sum(result.id in m for m in queued(cluster)) == 1
    with pytest.raises(CeleryTimeout):  # still waiting, not "lost"
        result.get(timeout=pooled_result.RECHECK_S + pooled_result.LOST_AFTER_S + 1)
    start_pool_worker(cluster)
    assert result.get(timeout=60)["output"]["id"] == "queued-1"


def test_a_request_redis_forgot_fails_its_caller_explicitly(cluster):
    stop_pool_workers(cluster)
    result = send_pooled(cluster.app, {"id": "forgotten", "duration_s": 0.1})
    lose_message(cluster, result.id)
    cluster.client.delete(records(cluster).of("default").record_key(result.id))  # Redis lost both
    started = time.monotonic()
    with pytest.raises(RequestLost) as caught:
        result.get()  # no timeout: it must not wait for ever
    took = time.monotonic() - started
    assert took < 2 * pooled_result.RECHECK_S + pooled_result.LOST_AFTER_S + 2, took
    text = str(caught.value)
    assert result.id in text and "send it again" in text and "\n" not in text


def test_pooled_infer_delay_records_and_its_end_forgets(cluster):
    from gpuhedge_celery.errors import UnknownPool
    from gpuhedge_celery.tasks.pool import pooled_infer

    start_pool_worker(cluster)
    rec = records(cluster)
    task = cluster.app.tasks[pooled_infer.name]
    ok = task.delay({"id": "delay-1", "duration_s": 0.1})
    assert isinstance(ok, pooled_result.PooledResult) and ok.recorded
    assert ok.get(timeout=60)["output"]["id"] == "delay-1"
    bad = task.apply_async(({"id": "x"},), {"pool": "no-such-pool"})
    with pytest.raises(UnknownPool):
        bad.get(timeout=60)
    deadline = time.monotonic() + 10
    while (
        rec.of("default").known(ok.id) or rec.of("default").known(bad.id)
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rec.of("default").known(ok.id) and not rec.of("default").known(bad.id)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.05)


def runs_of(cluster, request_id: str) -> int:
    from tests.support.faults import run_intervals

    runs = run_intervals(cluster.env["GPUHEDGE_TEST_RUN_LOG"])
    return sum(1 for gpu_runs in runs.values() for *_, rid in gpu_runs if rid == request_id)


def test_a_request_whose_waiting_process_died_is_sent_again_at_once(cluster):
    stop_pool_workers(cluster)
    start_pool_worker(cluster)
    rec = records(cluster)
    busy = send_pooled(cluster.app, {"id": "busy-1", "duration_s": 8})
    wait_for(
        lambda: rec.of("default").state(busy.id) == "handed", 20, "the first request on the GPU"
    )
    waiting = send_pooled(cluster.app, {"id": "orphan-1", "duration_s": 0.1})
    wait_for(
        lambda: rec.of("default").state(waiting.id) == "taken", 20, "the second request waiting"
    )
    assert not busy.ready()  # it waits for busy-1's GPU
    cluster.pool_workers[0].kill()  # kill -9 while the second request waits for the GPU
    cluster.pool_workers[0].process.wait(10)
    start_pool_worker(cluster)
    assert busy.get(timeout=30)["output"]["id"] == "busy-1"  # the GPU's job was not its to lose
    time.sleep(1.5)
    # its message waits unacknowledged for the broker's hour-long visibility timeout
    assert not waiting.ready() and rec.of("default").state(waiting.id) == "taken"
    assert resend_lost(cluster.app, rec) == [waiting.id]
    assert waiting.get(timeout=30)["output"]["id"] == "orphan-1"
    assert runs_of(cluster, "orphan-1") == 1


def test_a_second_delivery_while_the_first_waits_is_dropped(cluster):
    from gpuhedge_celery.tasks.app import TASK_POOLED_INFER

    if not getattr(cluster, "pool_workers", []):
        start_pool_worker(cluster)
    rec = records(cluster)
    busy = send_pooled(cluster.app, {"id": "busy-2", "duration_s": 6})
    wait_for(
        lambda: rec.of("default").state(busy.id) == "handed", 20, "the first request on the GPU"
    )
    request = {"id": "dup-1", "duration_s": 0.1}
    first = send_pooled(cluster.app, request)
    wait_for(
        lambda: rec.of("default").state(first.id) == "taken", 20, "the request waiting for the GPU"
    )
    assert not busy.ready()
    # what the Redis broker does past its visibility timeout while the first still waits
    cluster.app.send_task(TASK_POOLED_INFER, args=(request,), task_id=first.id, queue=QUEUE_POOL)
    assert busy.get(timeout=30)["output"]["id"] == "busy-2"
    assert first.get(timeout=30)["output"]["id"] == "dup-1"
    dropped = "a second delivery while another one has it"
    wait_for(lambda: dropped in "".join(w.log() for w in cluster.pool_workers), 10,
             "the duplicate dropped")  # fmt: skip
    time.sleep(0.5)
    assert runs_of(cluster, "dup-1") == 1


def test_a_send_that_fails_leaves_no_record_to_send_again(cluster, monkeypatch):
    """A publish that raised sent nothing: the caller has the error (and may send again), so
    the sweep must not find a record on no queue and send it a second time."""
    from celery.app.task import Task
    from kombu.exceptions import OperationalError

    from gpuhedge_celery.errors import StoreUnavailable
    from gpuhedge_celery.tasks.pool import pooled_infer

    def refuse(*args, **kwargs):
        raise OperationalError("broker unreachable")

    monkeypatch.setattr(cluster.app, "send_task", refuse)
    with pytest.raises(StoreUnavailable):  # the broker's error, as the package's
        send_pooled(cluster.app, {"text": "x"}, task_id="unsent-by-name")
    monkeypatch.setattr(Task, "apply_async", refuse)  # what pooled_infer.delay calls underneath
    with pytest.raises(StoreUnavailable):
        cluster.app.tasks[pooled_infer.name].apply_async(({"text": "x"},), task_id="unsent-delay")
    for request_id in ("unsent-by-name", "unsent-delay"):
        assert not records(cluster).of("default").known(request_id)
        assert cluster.client.zscore(records(cluster).of("default").unseen_key, request_id) is None


def test_a_request_whose_gpu_job_never_ran_is_sent_again_once_its_lease_ends(cluster):
    """Handed to a GPU, and then nothing: the process holding the lease died before it sent the
    GPU job, or the broker lost that message. Made by hand: the request is taken and handed
    under a lease nobody holds, and its message is gone."""
    stop_pool_workers(cluster)
    rec = records(cluster)
    result = send_pooled(cluster.app, {"id": "unrun-1", "duration_s": 0.1})
    lose_message(cluster, result.id)
    assert rec.of("default").take(result.id, "a-process-that-died", "d1") == "taken"
    assert rec.of("default").handoff(result.id, "d1", "gpu-nobody-holds", 7) == "handed"
    later = int(time.time() * 1000) + int(pooled_sweep.MISSING_S * 1000) + 100
    step = int(pooled_sweep.MISSING_S * 1000)
    assert resend_lost(cluster.app, rec, now_ms=later, leases=cluster.store) == []  # noted once
    assert resend_lost(cluster.app, rec, now_ms=later + step, leases=cluster.store) == [result.id]
    assert rec.of("default").state(result.id) == "sent"
    start_pool_worker(cluster)
    assert result.get(timeout=60)["output"]["id"] == "unrun-1"
    assert runs_of(cluster, "unrun-1") == 1


def test_a_handed_request_whose_gpu_job_holds_the_lease_is_left_alone(cluster):
    if not getattr(cluster, "pool_workers", []):
        start_pool_worker(cluster)
    rec = records(cluster)
    busy = send_pooled(cluster.app, {"id": "running-1", "duration_s": 5})
    wait_for(lambda: rec.of("default").state(busy.id) == "handed", 20, "the request on the GPU")
    time.sleep(pooled_sweep.MISSING_S + 0.2)
    step = int(pooled_sweep.MISSING_S * 1000)
    for n in range(3):
        now = int(time.time() * 1000) + n * step
        assert resend_lost(cluster.app, rec, now_ms=now, leases=cluster.store) == []
    assert busy.get(timeout=30)["output"]["id"] == "running-1"
    assert runs_of(cluster, "running-1") == 1


def test_a_request_whose_result_is_stored_is_never_sent_again(cluster):
    """Its end stored the result but could not delete the record (Redis blinked): the sweep
    finds it taken by a process that is gone, sees the stored result, and forgets it."""
    if not getattr(cluster, "pool_workers", []):
        start_pool_worker(cluster)
    rec = records(cluster)
    done = send_pooled(cluster.app, {"id": "ended-1", "duration_s": 0.1})
    assert done.get(timeout=30)["output"]["id"] == "ended-1"
    # the task forgets its record just after storing its result: wait for that, then put back
    # the record an end that failed to forget would have left
    deadline = time.monotonic() + 10
    while rec.of("default").known(done.id) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not rec.of("default").known(done.id), "the request's end never forgot its record"
    rec.of("default").sent(
        done.id, [{"id": "ended-1", "duration_s": 0.1}], {}, int(time.time() * 1000)
    )
    assert rec.of("default").take(done.id, "a-process-that-died", "d1") == "taken"
    time.sleep(pooled_sweep.ORPHAN_MIN_AGE_S + 0.2)
    assert resend_lost(cluster.app, rec, leases=cluster.store) == []
    assert not rec.of("default").known(done.id)
    time.sleep(1.0)
    assert runs_of(cluster, "ended-1") == 1
