"""Race events leave a process in batches: one ``task.multi`` publish per linger window.

A publish costs a coordination worker about as much as a race step, so under load events that
arrive within ``GPUHEDGE_EVENT_LINGER_MS`` of each other go out together. Checked on a real
Redis broker, in a fresh process (the Celery app reads its broker from the environment).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from gpuhedge_celery.race.settings import RaceSettings
from tests.support.fixtures_celery import CLUSTER

pytestmark = pytest.mark.cluster

CODE = """
import base64, json, sys, time
import redis
from gpuhedge_celery.tasks.race_runtime import CeleryEffects, race_settings

client = redis.Redis.from_url(sys.argv[1])
sub = client.pubsub()
sub.psubscribe(sys.argv[3] + "*celeryev/task.multi")  # this test's events only
sub.get_message(timeout=1)  # the psubscribe confirmation
effects = CeleryEffects(race_settings())
effects.hostname = "batch-test@localhost"
n = int(sys.argv[2])
for i in range(n):
    effects.event("race-1", "queued", {"i": i})
    time.sleep(0.01)  # events of a busy worker trickle in
effects.close()
messages, deadline = [], time.monotonic() + 5
while sum(len(m) for m in messages) < n and time.monotonic() < deadline:
    got = sub.get_message(timeout=0.5)
    if got and got["type"] == "pmessage":
        body = json.loads(got["data"])["body"]
        messages.append(json.loads(base64.b64decode(body)))
print(json.dumps([[e["i"] for e in m] for m in messages]))
"""


@pytest.fixture
def stores(redis_url, broker, request) -> tuple[str, str]:
    """The store's Redis and the broker's: the same, or the plain redis-server beside a Redis
    Cluster store (Celery cannot use a cluster)."""
    return redis_url, request.getfixturevalue("plain_redis_url") if broker == CLUSTER else redis_url


def _run(stores: tuple[str, str], linger_ms: str, n: int) -> list[list[int]]:
    redis_url, broker_url = stores
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    env = {
        **os.environ,
        "GPUHEDGE_REDIS_URL": redis_url,
        "GPUHEDGE_BROKER_URL": broker_url,
        "GPUHEDGE_BROKER_PREFIX": prefix,
        "GPUHEDGE_EVENT_LINGER_MS": linger_ms,
    }
    done = subprocess.run(
        [sys.executable, "-c", CODE, broker_url, str(n), prefix],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_events_within_the_linger_go_out_as_one_publish(stores):
    batches = _run(stores, "2000", 40)
    assert batches == [list(range(40))]  # one message, every event, in order


def test_without_a_linger_events_go_out_as_they_come_in_order(stores):
    batches = _run(stores, "0", 40)
    assert [i for b in batches for i in b] == list(range(40))
    assert len(batches) > 1  # the linger above is what made it one publish


def test_the_linger_is_a_validated_setting():
    assert RaceSettings().event_linger_ms == 100.0
    assert RaceSettings.from_env({"GPUHEDGE_EVENT_LINGER_MS": "0"}).event_linger_ms == 0.0
