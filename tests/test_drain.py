"""GPUs out of the pool: drained, faulted, unhealthy or not loaded take no lease, on a real Redis.

The claim scripts read the out-of-pool hash in the same step as the lease, so a waiter never
claims a drained GPU, even one it listed as a candidate; clearing the last reason wakes waiters
through the wake channel at once (not at their next re-check); ``gpuhedge-celery gpus drain``
returns when the GPUs are idle, ``undrain`` names a reason that still keeps one out, and
``leases`` shows all of it.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner

from gpuhedge_celery.cli import cli
from gpuhedge_celery.core.lease_rules import (
    DRAINED,
    DRAINING,
    IN_POOL,
    OUT,
    OUT_DRAIN,
    OUT_FAULT,
    OUT_HEALTH,
    OUT_RUNNER,
    availability,
)
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.store.availability import (
    busy,
    clear_out,
    drain,
    out_reasons,
    resolve_targets,
    set_out,
    undrain,
)
from gpuhedge_celery.store.waiter import LeaseWaiter
from tests.support.fixtures_leases import add_pool

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("listeners_closed"), pytest.mark.cluster]


def run(redis_url, prefix, *args):
    return CliRunner().invoke(cli, ["--redis-url", redis_url, "--prefix", prefix, *args])


@pytest.mark.parametrize(
    "out, leased, expected",
    [
        ({}, False, IN_POOL),
        ({}, True, IN_POOL),
        ({OUT_DRAIN: {}}, True, DRAINING),
        ({OUT_DRAIN: {}}, False, DRAINED),
        ({OUT_FAULT: {}, OUT_RUNNER: {}}, True, DRAINING),
        ({OUT_HEALTH: {}}, False, OUT),
        ({OUT_RUNNER: {}}, True, OUT),
    ],
)
def test_availability_table(out, leased, expected):
    assert availability(out, leased=leased) == expected


def test_a_gpu_out_of_the_pool_is_never_claimed(lease_store):
    (gpu,) = add_pool(lease_store, "p", 1)
    set_out(lease_store, gpu, OUT_RUNNER, "loading the model")
    assert lease_store.try_claim(gpu, "t1") is None
    assert lease_store.last_token(gpu) == 0, "no fencing token was spent on a refused claim"
    assert clear_out(lease_store, gpu, OUT_RUNNER) is True
    assert lease_store.try_claim(gpu, "t1").token > 0


def test_reasons_stack_and_keep_their_first_moment(lease_store):
    (gpu,) = add_pool(lease_store, "p", 1)
    set_out(lease_store, gpu, OUT_RUNNER, "loading")
    first = out_reasons(lease_store, gpu)[OUT_RUNNER]["since_ms"]
    time.sleep(0.01)
    set_out(lease_store, gpu, OUT_RUNNER, "load failed:\n  RuntimeError  x")
    set_out(lease_store, gpu, OUT_HEALTH, "pid 7 holds 2 GiB")
    reasons = out_reasons(lease_store, gpu)
    assert reasons[OUT_RUNNER] == {"detail": "load failed: RuntimeError x", "since_ms": first}
    assert clear_out(lease_store, gpu, OUT_RUNNER) is False, "health still keeps it out"
    assert clear_out(lease_store, gpu, OUT_HEALTH) is True
    with pytest.raises(ConfigError, match="reason"):
        set_out(lease_store, gpu, "tired", "x")


def test_waiters_skip_an_out_gpu_and_wake_the_moment_it_returns(lease_store):
    a, b = add_pool(lease_store, "p", 2)
    drain(lease_store, [a, b])
    waiter = LeaseWaiter(lease_store, recheck_s=30.0)  # only events can wake it in time
    got = {}

    def wait():
        got["lease"] = waiter.acquire("p", "w1", timeout_s=20)
        got["at"] = time.monotonic()

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.5)
    assert "lease" not in got, "a drained GPU is not free, though no lease holds it"
    assert lease_store.queue("p") == ["w1"]
    assert lease_store.last_token(a) == lease_store.last_token(b) == 0
    back_at = time.monotonic()
    assert undrain(lease_store, [b]) == {b: True}
    thread.join(10)
    assert got["lease"].gpu_id == b
    assert got["at"] - back_at < 1.0, "woken by the wake channel, not the 30 s re-check"


def test_drain_while_held_lets_the_job_finish(lease_store):
    (gpu,) = add_pool(lease_store, "p", 1)
    lease = lease_store.try_claim(gpu, "job", ttl_ms=10_000)
    drain(lease_store, [gpu])
    (row,) = lease_store.table("p")
    assert row.availability == DRAINING and row.out[OUT_DRAIN]["detail"]
    lease_store.renew(lease)  # the running job keeps its lease
    assert busy(lease_store, [gpu]) == [gpu]
    lease_store.release(lease)
    assert busy(lease_store, [gpu]) == []
    (row,) = lease_store.table("p")
    assert row.state == "free" and row.availability == DRAINED
    assert lease_store.try_claim(gpu, "next") is None


def test_targets_by_host_gpu_and_worker_node(lease_store):
    add_pool(lease_store, "p", 2, host="box")
    add_pool(lease_store, "q", 1, host="other")
    assert [g.gpu_id for g in resolve_targets(lease_store, "box")] == ["box:0", "box:1"]
    assert [g.gpu_id for g in resolve_targets(lease_store, "box:1")] == ["box:1"]
    assert [g.gpu_id for g in resolve_targets(lease_store, "other")] == ["other:0"]
    with pytest.raises(ConfigError, match=r"no registered GPU matches 'nope'.*hosts: box, other"):
        resolve_targets(lease_store, "nope")


def test_drain_cli_waits_for_the_running_job_then_undrain(lease_store, redis_url, prefix):
    a, b = add_pool(lease_store, "p", 2, host="box")
    lease = lease_store.try_claim(a, "job", ttl_ms=10_000)
    threading.Timer(0.6, lease_store.release, args=(lease,)).start()
    started = time.monotonic()
    out = run(redis_url, prefix, "gpus", "drain", "box")
    took = time.monotonic() - started
    assert out.exit_code == 0, out.output
    assert "draining box:0, box:1" in out.output and "waiting for the job(s) on box:0" in out.output
    assert "drained box:0, box:1: idle" in out.output
    assert 0.5 <= took < 5, "returned once the job released its GPU"
    table = run(redis_url, prefix, "leases")
    assert "drained: drained by an operator" in next(
        line for line in table.output.splitlines() if line.startswith("box:0")
    )
    set_out(lease_store, b, OUT_RUNNER, "loading tiny")
    back = run(redis_url, prefix, "gpus", "undrain", "box")
    assert back.exit_code == 0, back.output
    assert "box:0: back in the pool" in back.output
    assert "box:1: undrained, still out of the pool (runner: loading tiny)" in back.output
    rows = {
        r["gpu_id"]: r
        for r in json.loads(run(redis_url, prefix, "leases", "--json").output)["gpus"]
    }
    assert rows["box:0"]["availability"] == IN_POOL and rows["box:0"]["out"] == {}
    assert rows["box:1"]["availability"] == OUT and rows["box:1"]["out"][OUT_RUNNER]["detail"]


def test_drain_cli_no_wait_and_timeout(lease_store, redis_url, prefix):
    (gpu,) = add_pool(lease_store, "p", 1, host="box")
    lease_store.try_claim(gpu, "job", ttl_ms=10_000)
    out = run(redis_url, prefix, "gpus", "drain", "box:0", "--no-wait")
    assert out.exit_code == 0 and "waiting" not in out.output
    late = run(redis_url, prefix, "gpus", "drain", "box:0", "--timeout", "0.3")
    assert late.exit_code == 1 and "still busy after 0.3 s: box:0 (left drained)" in late.output
    table = run(redis_url, prefix, "leases").output
    assert "draining: drained by an operator" in table
    bad = run(redis_url, prefix, "gpus", "drain", "nohost")
    assert bad.exit_code != 0
