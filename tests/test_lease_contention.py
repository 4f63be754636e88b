"""Safety under real contention and pauses: separate processes on a real redis-server."""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict

import pytest

from gpuhedge_celery.errors import StaleToken
from tests.support.fixtures_leases import (
    SPAWN,
    add_pool,
    contention_worker,
    paused_holder,
)

pytestmark = pytest.mark.cluster

PROCESSES = 8
CLAIMS_EACH = 1000


def test_contention_no_overlap_and_tokens_strictly_increase(lease_store, redis_url, prefix):
    gpus = add_pool(lease_store, n=4)
    out = SPAWN.Queue()
    procs = [
        SPAWN.Process(
            target=contention_worker, args=(redis_url, prefix, gpus, CLAIMS_EACH, seed, out)
        )
        for seed in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    reports = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    per_gpu = defaultdict(list)
    for _seed, _attempts, intervals in reports:
        assert len(intervals) == CLAIMS_EACH
        for gpu, token, start, end in intervals:
            per_gpu[gpu].append((start, end, token))
    assert sum(len(v) for v in per_gpu.values()) == PROCESSES * CLAIMS_EACH
    for gpu, intervals in per_gpu.items():
        intervals.sort()
        for (s1, e1, t1), (s2, e2, t2) in zip(intervals, intervals[1:], strict=False):
            assert e1 <= s2, f"GPU {gpu}: held intervals overlap ({s1}, {e1}) and ({s2}, {e2})"
            assert t1 < t2, f"GPU {gpu}: token {t2} after {t1} is not increasing"
        # Every issued token belongs to exactly one successful claim, the last one included.
        tokens = [t for _, _, t in intervals]
        assert len(set(tokens)) == len(tokens)
        assert lease_store.last_token(gpu) == max(tokens)


def test_paused_holder_is_rejected_and_fenced(lease_store, redis_url, prefix):
    (gpu,) = add_pool(lease_store)
    out, go = SPAWN.Queue(), SPAWN.Event()
    child = SPAWN.Process(target=paused_holder, args=(redis_url, prefix, gpu, 500, out, go))
    child.start()
    try:
        kind, old_token, pid = out.get(timeout=60)
        assert kind == "claimed"
        os.kill(pid, signal.SIGSTOP)
        time.sleep(1.0)  # past the 500 ms TTL, with no renewal possible
        lease = lease_store.try_claim(gpu, "next-holder", ttl_ms=30_000)
        assert lease is not None and lease.token > old_token
        lease_store.check_fence(gpu, lease.token)  # the worker starts the new job
        os.kill(pid, signal.SIGCONT)
        go.set()
        kind, report = out.get(timeout=60)
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.join(30)
    assert report["keeper_lost"] is True
    assert report["on_lost_after"] == ["LeaseLost"]  # called exactly once
    assert report["release"] == "LeaseLost"
    assert report["renew"] == "LeaseLost"
    assert report["check_fence"] == StaleToken.__name__
    current = lease_store.current(gpu)
    assert current.token == lease.token and current.holder == "next-holder"
