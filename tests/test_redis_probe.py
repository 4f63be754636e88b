"""The bench's Redis probe: one round trip per request redis-py sends, and where it came from.

Run in a child process (the probe patches redis-py for the whole process) on the real Redis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

CHILD = """
import json, sys
import redis
from gpuhedge_celery.bench import redis_probe
from gpuhedge_celery.store.races import RaceStore

redis_probe.install()
client = redis.Redis.from_url(sys.argv[1], decode_responses=True)
client.ping()  # a plain command: one round trip (the connection's own setup adds none here)
before = redis_probe.totals()["round_trips"]
pipe = client.pipeline(transaction=False)
for i in range(5):
    pipe.set(f"{sys.argv[2]}:k{i}", i)
pipe.execute()  # five commands, one round trip
after_pipe = redis_probe.totals()["round_trips"]


def operator_script():
    return RaceStore(client, sys.argv[2]).load("no-such-race")


operator_script()
from gpuhedge_celery.race.receipt import with_payload

with_payload({"payload_ref": sys.argv[2] + ":no-such-payload", "payload_bytes": 1}, client)
from gpuhedge_celery.providers.simledger import RedisLedger

RedisLedger(client, sys.argv[2]).get("sim:job:p:none")  # the simulated providers' own request
print(json.dumps({"pipeline": after_pipe - before, **redis_probe.totals()}))
"""


def run_child(redis_url, prefix, sites):
    env = {**os.environ, "GPUHEDGE_BENCH_PROBE_SITES": sites}
    out = subprocess.run([sys.executable, "-c", CHILD, redis_url, prefix], env=env,
                         capture_output=True, text=True, timeout=50, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_pipeline_is_one_round_trip_and_sites_name_the_store_call_and_its_caller(
    redis_url, prefix
):
    found = run_child(redis_url, prefix, "on")
    assert found["pipeline"] == 1
    assert found["bytes"] > 0
    sites = found["sites"]
    assert sum(sites.values()) == found["round_trips"]
    # the race store's read, called from outside the package: the store function is named
    assert any(k.startswith("store.races:load") for k in sites), sites
    # a package function outside the store that sends its own command is named alone
    assert sites.get("race.receipt:with_payload") == 1, sites
    # the sim ledger's request is counted apart too (it stands in for a provider's API)
    assert found["sim_round_trips"] == 1 and sites.get("providers.simledger:get") == 1


def test_without_sites_only_totals_are_counted(redis_url, prefix):
    found = run_child(redis_url, prefix, "off")
    assert found["pipeline"] == 1 and "sites" not in found
    assert found["sim_round_trips"] == 1 and 0 < found["sim_bytes"] < found["bytes"]
