"""An adaptive policy in real races: two Celery coordination workers, sim providers on compressed
time, a primary that slows halfway through. The learned hedge timing follows the change (from
hedging next to nothing to hedging nearly every request well before the slow primary ends),
and ``policy show`` and the Redis gauges say so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.support.fixtures_races import REPO, start_race_cluster, stop_race_cluster

NAME = "adaptive:p->h@d3s"  # a 3 s deadline in real time: 300 s of provider time at 0.01
HEDGE = {"queue_s": 0.2, "run_s": 5}  # 52 ms real
FAST = {"sim": {"p": {"queue_s": 0.5, "run_s": 2}, "h": HEDGE}}  # the primary: 25 ms real
SLOW = {"sim": {"p": {"queue_s": 0.5, "run_s": 60}, "h": HEDGE}}  # 605 ms real


@pytest.fixture(scope="module")
def rc(redis_url: str, tmp_path_factory: Any, broker: Any, request: Any) -> Any:
    from tests.support.fixtures_celery import broker_url_for

    cluster = start_race_cluster(
        redis_url, tmp_path_factory.mktemp("adaptive"), broker_url=broker_url_for(broker, request)
    )
    yield cluster
    stop_race_cluster(cluster)


def _races(rc: Any, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run the races eight at a time, each batch after the learners read the last one."""
    results = []
    for i in range(0, len(requests), 8):
        sent = [rc.send(r, policy=NAME) for r in requests[i : i + 8]]
        results += [s.get(timeout=30) for s in sent]
        for s in sent:
            rc.receipt(s.id)  # finished: its observation is in the shared stream
        time.sleep(1.2)  # past the learners' one-second read of the stream
    return results


def _settled(rc: Any, request: dict[str, Any], races: int) -> dict[str, Any]:
    """``policy show`` once the fleet's published plan was learned from at least ``races``
    races: a coordinator reads the shared stream when a race starts (at most once a second, in
    a thread of its own), so a race is sent each second until one has."""
    deadline = time.monotonic() + 30
    while True:
        shown = _show(rc)
        learned = shown["learned"] or {}
        if learned.get("races", 0) >= races or time.monotonic() > deadline:
            return shown
        rc.send(request, policy=NAME).get(timeout=30)
        time.sleep(1.1)


def _show(rc: Any) -> dict[str, Any]:
    env = {**os.environ, "GPUHEDGE_REDIS_URL": rc.redis_url, "GPUHEDGE_PREFIX": rc.prefix}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-m", "gpuhedge_celery.cli", "policy", "show", NAME, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def test_the_hedge_timing_follows_a_primary_that_slows(rc: Any) -> None:
    from gpuhedge_celery.metrics.redis_gauges import RedisGauges

    before = _show(rc)
    assert before["learned"] is None and before["requests"] == 0

    _races(rc, [FAST] * 24)
    fast = _settled(rc, FAST, 24)
    learned = fast["learned"]
    assert learned is not None and learned["races"] >= 24
    assert fast["requests"] >= 24
    fast_plan = learned["plan"]
    # a primary that answers in 25 ms is left alone (no hedge at all, or one well past that)
    never = fast_plan["hedge"] is None or fast_plan["safety_s"] is None
    fast_safety = float("inf") if never else fast_plan["safety_s"]
    assert fast_safety > 0.025
    assert learned["estimate"]["hedge_share"] < 0.2  # it expects to hedge next to nothing

    results = _races(rc, [SLOW] * 40)
    slow = _settled(rc, SLOW, learned["races"] + 40)
    slow_plan = slow["learned"]["plan"]
    assert slow["learned"]["races"] > learned["races"]
    assert slow_plan["hedge"] == "h"
    # the hedge now goes long before the slow primary's 605 ms, on nearly every request
    assert slow_plan["safety_s"] is not None and slow_plan["safety_s"] < 0.3, slow["learned"]
    assert slow["learned"]["estimate"]["hedge_share"] > 0.6, slow["learned"]  # old samples weigh
    # the last races were won by the hedge, launched on the learned timing
    assert [r["winner"] for r in results[-8:]] == ["h"] * 8

    reading = RedisGauges(rc.client, rc.prefix).read()
    canonical = slow["policy"]
    assert reading.get("gpuhedge_adaptive_plan_seconds", canonical, "safety") == pytest.approx(
        slow_plan["safety_s"]
    )
    assert reading.get("gpuhedge_adaptive_provider", canonical, "hedge", "h") == 1.0
    assert reading.get("gpuhedge_adaptive_races_learned", canonical) == slow["learned"]["races"]


def test_reset_forgets_what_it_learned(rc: Any) -> None:
    env = {**os.environ, "GPUHEDGE_REDIS_URL": rc.redis_url, "GPUHEDGE_PREFIX": rc.prefix}
    subprocess.run(
        [sys.executable, "-m", "gpuhedge_celery.cli", "policy", "reset", NAME, "--yes"],
        env={**env, "PYTHONPATH": str(REPO)},
        check=True,
        capture_output=True,
        timeout=60,
    )
    shown = _show(rc)
    assert shown["learned"] is None and shown["seen"] == 0
    _races(rc, [FAST] * 8)
    again = _settled(rc, FAST, 8)
    assert again["learned"] is not None and 8 <= again["learned"]["races"] <= 20
