"""Cancels under the fleet's ``/cancel`` budget: queued jobs' cancels go first.

RunPod allows 100 ``/cancel`` per 10 s per endpoint. When races decide cancels faster than
that, a queued job stopped now costs nothing while a running one costs only its next seconds:
the cancel of a job seen running takes its token *behind* the others (it leaves half the burst
to them and never reserves a slot), and each receipt says how long its cancel waited.
"""

from __future__ import annotations

import threading

import pytest

from gpuhedge_celery.core.receipts import Evidence
from gpuhedge_celery.providers.base import CancelsBehindQueued
from gpuhedge_celery.providers.ratelimit import LocalLimiter, RedisLimiter, RouteLimit
from tests.support.runpod_fake import runpod_provider

pytestmark = pytest.mark.timeout(90)

RL = RouteLimit("cancel", 100, 10.0, 0.9)  # a burst of 10, then 8 tokens a second; hold 5


def test_a_taker_behind_leaves_the_hold_and_never_reserves():
    now = [0.0]
    limiter = LocalLimiter(clock=lambda: now[0])
    assert RL.hold == 5
    # a full bucket: behind takers get what is free beyond the hold, then are sent away
    granted = [limiter.take("ep", RL, 10.0, behind=True) for _ in range(6)]
    assert [g.granted for g in granted] == [True] * 5 + [False]
    assert granted[5].wait_s == pytest.approx(1 / RL.rate_per_s)  # when one is free again
    # the others still get the five tokens held for them, then reserve as before
    first = [limiter.take("ep", RL, 10.0) for _ in range(6)]
    assert all(g.granted for g in first) and [g.wait_s for g in first[:5]] == [0.0] * 5
    assert first[5].wait_s == pytest.approx(0.125)
    # a behind taker is refused while those reservations are pending, and took nothing
    assert not limiter.take("ep", RL, 10.0, behind=True).granted
    assert limiter.take("ep", RL, 10.0).wait_s == pytest.approx(0.25)


@pytest.mark.parametrize("limit", [2, 10, 19])
def test_a_small_bucket_holds_nothing_back_so_a_running_jobs_cancel_still_goes(limit):
    small = RouteLimit("cancel", limit, 10.0, 0.9)  # a burst of 1: nothing to hold back
    assert small.hold == 0
    assert LocalLimiter(clock=lambda: 0.0).take("ep", small, 5.0, behind=True).granted


def test_the_redis_bucket_keeps_the_same_hold(redis_client, prefix):
    limiter = RedisLimiter(redis_client, prefix)
    slow = RouteLimit("cancel", 100, 1000.0, 0.9)  # hardly refills during the test
    behind = [limiter.take("runpod:ep", slow, 5.0, behind=True) for _ in range(6)]
    assert [g.granted for g in behind] == [True] * 5 + [False]
    ahead = [limiter.take("runpod:ep", slow, 0.0) for _ in range(5)]
    assert all(g.granted and g.wait_s == 0 for g in ahead)  # the held five
    assert not limiter.take("runpod:ep", slow, 0.0).granted


def test_queued_jobs_cancels_reach_runpod_before_running_ones(runpod):
    """12 running and 12 queued losers cancelled at once on a 20-per-10 s /cancel budget: every
    queued job's cancel is sent before any running job's that had to wait."""
    runpod.configure(cancel_stop_s=0.05)
    limits = {"window_s": 10, "run": 1000, "status": 2000, "cancel": 20, "shared": False}
    p = runpod_provider(runpod, rate_limits=limits, cancel_confirm_s=20)
    assert isinstance(p, CancelsBehindQueued)
    fate = {"runpod_fake": {"*": {"queue_s": 0.0, "run_s": 60}}}
    running = [p.submit(fate) for _ in range(12)]
    queued = [p.submit({"runpod_fake": {"*": {"queue_s": 60, "run_s": 1}}}) for _ in range(12)]
    receipts: dict[str, object] = {}

    def cancel(handle, behind):
        receipts[handle.job_id] = (p.cancel_running if behind else p.cancel)(handle)

    threads = [threading.Thread(target=cancel, args=(h, True)) for h in running]
    threads += [threading.Thread(target=cancel, args=(h, False)) for h in queued]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(receipts) == 24
    for r in receipts.values():
        assert r.evidence is Evidence.CONFIRMED_TERMINAL and not r.leaked
    queued_sent = [receipts[h.job_id].cancel_ack_ms for h in queued]
    waited = [receipts[h.job_id] for h in running if receipts[h.job_id].token_wait_ms > 50]
    assert waited, "the budget should have made some running jobs' cancels wait"
    assert max(queued_sent) <= min(r.cancel_ack_ms for r in waited)
    # every queued job was stopped before it started: no execution billed
    assert all(receipts[h.job_id].reconciled_cost_usd == 0 for h in queued)
    assert all(r.token_wait_ms is not None for r in receipts.values())
