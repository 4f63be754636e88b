"""The lease store on a real redis-server: claim, fencing, renew/release, registry, reconcile."""

from __future__ import annotations

import json
import time

import pytest
import redis

from gpuhedge_celery.errors import (
    ConfigError,
    EmptyPool,
    LeaseLost,
    StaleToken,
    StoreUnavailable,
    UnknownPool,
)
from gpuhedge_celery.store.keeper import LeaseKeeper
from gpuhedge_celery.store.leases import GpuInfo, Lease, LeaseStore
from tests.support.fixtures_leases import add_pool, wait_until

pytestmark = [pytest.mark.usefixtures("listeners_closed"), pytest.mark.cluster]


def test_claim_is_exclusive_and_tokens_increase(lease_store):
    (gpu,) = add_pool(lease_store, ttl_ms=5_000)
    first = lease_store.try_claim(gpu, "a")
    assert first is not None and first.token > 0 and first.ttl_ms == 5_000
    assert first.pool == "default" and first.holder == "a" and first.since_ms > 0
    assert lease_store.try_claim(gpu, "b") is None
    lease_store.release(first)
    second = lease_store.try_claim(gpu, "b", ttl_ms=2_000)
    assert second.token > first.token and second.ttl_ms == 2_000
    assert (
        0 < lease_store.client.pttl(lease_store.keys.lease(lease_store.pool_of(gpu), gpu)) <= 2_000
    )
    assert lease_store.current(gpu).token == second.token == lease_store.last_token(gpu)


def test_release_and_renew_by_a_stale_holder_raise(lease_store):
    (gpu,) = add_pool(lease_store)
    old = lease_store.try_claim(gpu, "old", ttl_ms=100)
    time.sleep(0.25)
    with pytest.raises(LeaseLost, match="expired"):
        lease_store.renew(old)
    new = lease_store.try_claim(gpu, "new")
    assert new.token > old.token
    with pytest.raises(LeaseLost, match="another lease"):
        lease_store.release(old)
    with pytest.raises(LeaseLost):
        lease_store.renew(old)
    assert lease_store.current(gpu).token == new.token  # the new holder kept the GPU
    renewed = lease_store.renew(new, ttl_ms=9_000)
    assert (
        renewed.ttl_ms == 9_000
        and lease_store.client.pttl(lease_store.keys.lease(lease_store.pool_of(gpu), gpu)) > 8_000
    )
    lease_store.release(new)
    with pytest.raises(LeaseLost):
        lease_store.release(new)


def test_check_fence_accepts_current_refuses_older_and_released(lease_store):
    (gpu,) = add_pool(lease_store)
    a = lease_store.try_claim(gpu, "a")
    lease_store.check_fence(gpu, a.token)
    lease_store.check_fence(gpu, a.token)  # idempotent for the same job
    lease_store.force_release(gpu)
    with pytest.raises(LeaseLost):
        lease_store.check_fence(gpu, a.token)  # not the current lease any more
    b = lease_store.try_claim(gpu, "b")
    lease_store.check_fence(gpu, b.token)
    with pytest.raises(StaleToken) as info:
        lease_store.check_fence(gpu, a.token)
    assert info.value.current == b.token
    assert lease_store.accepted_token(gpu) == b.token


def test_force_release_and_restore_for_reconcile(lease_store):
    (gpu,) = add_pool(lease_store, ttl_ms=4_000)
    a = lease_store.try_claim(gpu, "a")
    assert not lease_store.force_release(gpu, token=a.token + 7)  # another token: left alone
    assert lease_store.force_release(gpu, token=a.token)
    assert not lease_store.force_release(gpu)  # nothing left
    # The worker reports it is still running job a: the lease comes back with a's token.
    assert lease_store.restore(gpu, "a", a.token, since_ms=12345)
    back = lease_store.current(gpu)
    assert (back.token, back.holder, back.since_ms, back.ttl_ms) == (a.token, "a", 12345, 4_000)
    assert lease_store.restore(gpu, "a", a.token)  # idempotent
    assert not lease_store.restore(gpu, "x", a.token + 1)  # another token holds it
    lease_store.release(back)
    nxt = lease_store.try_claim(gpu, "b")
    assert nxt.token > a.token
    lease_store.check_fence(gpu, nxt.token)
    lease_store.release(nxt)
    assert not lease_store.restore(gpu, "a", a.token)  # older than an accepted token: refused
    # Restoring a token beyond the counter moves the counter, so no later claim reuses it.
    ahead = nxt.token + 10**12  # about 11 days of the clock floor ahead
    assert lease_store.restore(gpu, "z", ahead)
    lease_store.force_release(gpu)
    assert lease_store.try_claim(gpu, "c").token == ahead + 1


def test_registry_pools_hosts_and_liveness(lease_store):
    add_pool(lease_store, "a", 2, host="hostA", labels=[{"model": "x"}, {"model": "y"}])
    add_pool(lease_store, "b", 1, host="hostB", heartbeat_ms=150)
    assert lease_store.pools() == ["a", "b"]
    assert [g.gpu_id for g in lease_store.gpus("a")] == ["hostA:0", "hostA:1"]
    assert lease_store.gpus("a")[1].labels == {"model": "y"}
    assert wait_until(lambda: not lease_store.host_live("hostB"), 3)
    assert lease_store.gpus("b") == []  # its host stopped heartbeating
    assert [g.gpu_id for g in lease_store.gpus("b", live_only=False)] == ["hostB:0"]
    with pytest.raises(EmptyPool):
        lease_store.live_gpus("b")
    with pytest.raises(UnknownPool):
        lease_store.live_gpus("nope")
    # Moving a GPU to another pool removes it from the old one.
    lease_store.register_gpu(GpuInfo("hostA:1", "b", "hostA"))
    assert [g.gpu_id for g in lease_store.gpus("a")] == ["hostA:0"]
    assert [g.gpu_id for g in lease_store.gpus("b")] == ["hostA:1"]
    assert lease_store.unregister_gpu("hostA:1") and not lease_store.unregister_gpu("hostA:1")
    assert lease_store.gpus("b", live_only=False) == [
        GpuInfo("hostB:0", "b", "hostB", {}),
    ]


def test_a_process_that_cached_a_gpus_old_pool_claims_it_in_the_new_one(lease_store):
    add_pool(lease_store, "a", 1, host="h")
    other = LeaseStore(lease_store.client, lease_store.prefix)  # another process
    assert other.pool_of("h:0") == "a"  # read, and cached
    lease_store.register_gpu(GpuInfo("h:0", "b", "h"))
    lease = other.try_claim("h:0", "job-1")  # its pool's registry no longer has the GPU
    assert lease is not None and lease.pool == "b" and other.pool_of("h:0") == "b"
    assert lease_store.current("h:0") == lease
    with pytest.raises(ConfigError, match="invalid pool name"):
        lease_store.register_gpu(GpuInfo("h:1", "a{b}", "h"))


def test_a_workers_own_gpu_is_found_in_its_configured_pool_before_it_registers(lease_store):
    from gpuhedge_celery.store.availability import set_out

    with pytest.raises(ConfigError, match="not registered"):
        set_out(lease_store, "w:0", "runner", "loading")
    lease_store.expect("w:0", "p")  # what a GPU worker's own store knows from its config
    set_out(lease_store, "w:0", "runner", "loading")
    add_pool(lease_store, "p", 1, host="w")
    assert lease_store.try_claim("w:0", "job") is None  # the mark kept it out of the pool


def test_a_workers_own_gpu_moved_to_another_pool_is_marked_there_before_it_registers(
    lease_store,
):
    from gpuhedge_celery.store.availability import set_out

    add_pool(lease_store, "a", 1, host="w")  # registered in a by the worker's old config
    moved = LeaseStore(lease_store.client, lease_store.prefix)  # the restarted worker's child
    moved.expect("w:0", "b")
    set_out(moved, "w:0", "runner", "loading")  # its model loads: out of pool b at once
    moved.register_gpu(GpuInfo("w:0", "b", "w"))
    caller = LeaseStore(lease_store.client, lease_store.prefix)  # a process that never read it
    assert caller.pool_of("w:0") == "b"
    assert caller.try_claim("w:0", "job") is None  # b never had it without the mark


def test_table_states(lease_store):
    add_pool(lease_store, "p", 3, host="live")
    add_pool(lease_store, "q", 1, host="dying", heartbeat_ms=200)
    held = lease_store.try_claim("live:0", "job-1", ttl_ms=10_000)
    old = lease_store.try_claim("live:1", "job-2")
    lease_store.force_release("live:1")
    newer = lease_store.try_claim("live:1", "job-3")
    lease_store.check_fence("live:1", newer.token)
    lease_store.force_release("live:1")
    assert lease_store.restore("live:1", "job-2", old.token) is False  # refused: stale
    lease_store.client.set(
        lease_store.keys.lease(lease_store.pool_of("live:1"), "live:1"),
        f"{old.token}|1|job-2",
        px=10_000,
    )
    lease_store.try_claim("dying:0", "job-4")
    assert wait_until(lambda: not lease_store.host_live("dying"), 3)
    rows = {r.gpu_id: r for r in lease_store.table()}
    assert rows["live:0"].state == "held" and rows["live:0"].holder == "job-1"
    assert rows["live:0"].token == held.token and 0 < rows["live:0"].ttl_left_ms <= 10_000
    assert rows["live:1"].state == "stale"  # the worker accepted a newer token already
    assert rows["live:2"].state == "free" and rows["live:2"].holder is None
    assert rows["dying:0"].state == "stale" and rows["dying:0"].host_live is False
    assert [r.gpu_id for r in lease_store.table("q")] == ["dying:0"]
    json.dumps([r.to_dict() for r in lease_store.table()])
    with pytest.raises(UnknownPool):
        lease_store.table("nope")


@pytest.mark.parametrize("ttl", [0, -1, -1000, 2.5, "10"])
def test_ttl_must_be_positive(lease_store, ttl):
    (gpu,) = add_pool(lease_store)
    with pytest.raises(ConfigError, match="ttl_ms"):
        lease_store.set_pool_ttl("default", ttl)
    with pytest.raises(ConfigError, match="ttl_ms"):
        lease_store.try_claim(gpu, "a", ttl_ms=ttl)
    with pytest.raises(ConfigError, match="ttl_ms"):
        lease_store.host_heartbeat("h1", ttl)
    assert lease_store.current(gpu) is None


def test_bad_names_and_unknown_gpu(lease_store):
    with pytest.raises(ConfigError, match="gpu_id"):
        lease_store.register_gpu(GpuInfo("", "p", "h"))
    with pytest.raises(ConfigError, match="pool"):
        lease_store.register_gpu(GpuInfo("g", "two words", "h"))
    with pytest.raises(ConfigError, match="not registered"):
        lease_store.try_claim("ghost:0", "a")


def test_pool_ttl_default_and_set(lease_store):
    (gpu,) = add_pool(lease_store)
    assert lease_store.pool_ttl("default") == 60_000
    lease_store.set_pool_ttl("default", 1234)
    assert lease_store.pool_ttl("default") == 1234
    assert lease_store.try_claim(gpu, "a").ttl_ms == 1234


def test_lease_travels_as_json():
    lease = Lease("h:0", "default", 7, "task-1", 30_000, 99)
    assert Lease.from_dict(json.loads(json.dumps(lease.to_dict()))) == lease
    info = GpuInfo("h:0", "default", "h", {"model": "llama"})
    assert GpuInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info


def test_redis_unreachable_is_typed():
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from tests.support.redis_server import free_port

    client = redis.Redis(
        port=free_port(),
        socket_connect_timeout=0.5,
        decode_responses=True,
        retry=Retry(NoBackoff(), 0),
    )
    store = LeaseStore(client, prefix="x")
    with pytest.raises(StoreUnavailable, match="unreachable"):
        store.try_claim("h:0", "a")
    with pytest.raises(StoreUnavailable):
        store.table()


def test_durations_recorded_newest_first(lease_store):
    for d in (1.0, 2.5, 3.25):
        lease_store.record_duration("p", d)
    assert lease_store.durations("p") == [3.25, 2.5, 1.0]
    with pytest.raises(ConfigError):
        lease_store.record_duration("p", -1)


# -- the keeper -----------------------------------------------------------------------------
def test_keeper_keeps_a_long_job_alive(lease_store):
    (gpu,) = add_pool(lease_store)
    lease = lease_store.try_claim(gpu, "long", ttl_ms=600)
    with LeaseKeeper(lease_store, lease) as keeper:
        time.sleep(2.0)  # more than three TTLs
        assert not keeper.lost.is_set() and keeper.renewals >= 3
        assert lease_store.current(gpu).token == lease.token
    lease_store.release(lease)


def test_keeper_reports_a_lost_lease_once(lease_store):
    (gpu,) = add_pool(lease_store)
    lease = lease_store.try_claim(gpu, "a", ttl_ms=600)
    calls = []
    keeper = LeaseKeeper(
        lease_store, lease, on_lost=lambda ls, e: calls.append((ls.token, e)), interval_s=0.05
    ).start()
    lease_store.force_release(gpu)  # reconcile took it away
    assert keeper.lost.wait(3)
    time.sleep(0.2)
    keeper.stop()
    assert len(calls) == 1 and calls[0][0] == lease.token
    assert isinstance(calls[0][1], LeaseLost) and isinstance(keeper.error, LeaseLost)


def test_keeper_declares_lost_when_redis_is_gone_past_the_ttl(private_redis):
    client = redis.Redis.from_url(private_redis.url, decode_responses=True, socket_timeout=0.5)
    store = LeaseStore(client, prefix="k")
    (gpu,) = add_pool(store)
    lease = store.try_claim(gpu, "a", ttl_ms=600)
    keeper = LeaseKeeper(store, lease, interval_s=0.1).start()
    started = time.monotonic()
    private_redis.stop()
    assert keeper.lost.wait(5)
    assert isinstance(keeper.error, StoreUnavailable)
    assert time.monotonic() - started >= 0.4  # not before the lease could have expired
    keeper.stop()
