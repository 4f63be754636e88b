"""Fencing tokens never go back, across a failover that lost writes too.

A token is the larger of the GPU's INCR'd fence counter and Redis's clock in ms x 1000
(``store/lua/_token.lua``); a failover that lost the counter's last writes is played by setting
the counter lower or deleting it, as the promoted replica would have it. Renew and release check
the holder as well as the token, and a GPU worker's own mark refuses an old token even when
Redis lost the highest-accepted key; the lease it refuses is freed and the counter lifted to the
mark, so a new primary whose clock is behind does not refuse every claim. Scripts run on the
real redis-server.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import pytest

from gpuhedge_celery.errors import LeaseLost, StaleToken, StoreUnavailable
from gpuhedge_celery.store.direct import DirectClaims
from gpuhedge_celery.store.leases import LeaseStore
from gpuhedge_celery.store.pooled import PooledRecords
from gpuhedge_celery.store.scripts import _lua_source, _read_lua
from gpuhedge_celery.store.waiter import LeaseWaiter
from gpuhedge_celery.tasks.gpu_steps import STARTED, RunningRecord, begin, finish
from tests.support.fixtures_leases import add_pool

pytestmark = [pytest.mark.usefixtures("listeners_closed"), pytest.mark.cluster]

ISSUERS = ("claim", "wait_claim", "pooled_direct")


def test_scripts_that_issue_or_write_tokens_get_the_shared_rule():
    rule = _read_lua("_token")
    for name in (*ISSUERS, "restore", "check_fence", "fence_lift"):
        assert _lua_source(name) == rule + _read_lua(name), name
    for name in ("renew", "release", "force_release", "gpu_finish"):
        assert _lua_source(name) == _read_lua(name), name
    for name in ISSUERS:  # the counter moves only through next_token
        assert "next_token(" in _read_lua(name) and "'INCR', KEYS[2]" not in _read_lua(name)


def issue(store: LeaseStore, how: str, pool: str, holder: str):
    """A lease taken through one of the scripts that issue tokens."""
    if how == "claim":
        return store.try_claim(f"{pool}:0", holder)
    if how == "wait_claim":
        return LeaseWaiter(store).acquire(pool, holder, timeout_s=5)
    records = PooledRecords(store.client, store.keys)
    return DirectClaims(store, records).claim(holder, [], {"pool": pool}, None)


def server_floor(store: LeaseStore) -> int:
    seconds, micros = store.client.time()
    return (seconds * 1000 + micros // 1000) * 1000


@pytest.mark.parametrize("how", ISSUERS)
def test_a_token_after_the_counter_went_back_is_above_every_earlier_one(lease_store, how):
    (gpu,) = add_pool(lease_store, "p", host="p")
    fence = lease_store.keys.fence(lease_store.pool_of(gpu), gpu)
    earlier = []
    for i in range(20):
        lease = issue(lease_store, how, "p", f"before-{i}")
        earlier.append(lease.token)
        lease_store.release(lease)
    assert earlier == sorted(set(earlier))
    for went_back in ("deleted", "lower"):
        time.sleep(0.002)  # the failover took at least a millisecond
        if went_back == "deleted":
            lease_store.client.delete(fence)
        else:
            lease_store.client.set(fence, 5)
        lease = issue(lease_store, how, "p", f"after-{went_back}")
        assert lease.token > max(earlier), went_back
        assert lease_store.last_token(gpu) == lease.token  # the floor won: the counter follows it
        assert lease_store.current(gpu).token == lease.token
        earlier.append(lease.token)
        lease_store.release(lease)


def test_tokens_strictly_increase_across_many_claims(lease_store):
    (gpu,) = add_pool(lease_store)
    before = server_floor(lease_store)
    tokens = []
    for i in range(1500):  # many in one millisecond: the counter's INCR decides those
        lease = lease_store.try_claim(gpu, f"h{i}")
        tokens.append(lease.token)
        lease_store.release(lease)
    assert all(a < b for a, b in zip(tokens, tokens[1:], strict=False))
    assert tokens[0] >= before and lease_store.last_token(gpu) == tokens[-1]
    assert tokens[-1] < 2**53  # exact as a Lua number


def test_big_round_tokens_are_written_as_integers(lease_store, redis_client):
    (gpu,) = add_pool(lease_store, "p", host="p")
    k = lease_store.keys
    # A multiple of 10**14 above the clock's floor: Lua 5.1's tostring gives it as '1.8e+15'.
    step = 10**14
    for n, how in enumerate(ISSUERS, 1):
        at = (server_floor(lease_store) // step + n) * step
        redis_client.set(k.fence(lease_store.pool_of(gpu), gpu), at - 1)
        lease = issue(lease_store, how, "p", f"job-{how}")
        assert lease.token == at, how
        assert redis_client.get(k.lease(lease_store.pool_of(gpu), gpu)).startswith(f"{at}|"), how
        assert redis_client.get(k.fence(lease_store.pool_of(gpu), gpu)) == str(at), how
        assert lease_store.current(gpu).token == at
        if how == "pooled_direct":
            record = PooledRecords(redis_client, k).of("p").record_key(lease.holder)
            assert redis_client.hget(record, "token") == str(at)
        lease_store.check_fence(gpu, at, how)
        assert redis_client.get(k.accepted(lease_store.pool_of(gpu), gpu)) == str(at)
        lease_store.renew(lease)
        lease_store.release(lease)
    later = at + step
    assert lease_store.restore(gpu, "restored", later, since_ms=7)
    assert redis_client.get(k.lease(lease_store.pool_of(gpu), gpu)) == f"{later}|7|restored"
    assert redis_client.get(k.fence(lease_store.pool_of(gpu), gpu)) == str(later)
    assert lease_store.try_claim(gpu, "next") is None  # restored: held
    lease_store.force_release(gpu, later)
    assert lease_store.try_claim(gpu, "next").token == later + 1


def test_renew_and_release_refuse_the_right_token_with_another_holder(lease_store):
    (gpu,) = add_pool(lease_store)
    lease = lease_store.try_claim(gpu, "job-a")
    # After a failover that re-issued the number, another holder carries the same token.
    other = replace(lease, holder="job-b")
    with pytest.raises(LeaseLost, match="another lease"):
        lease_store.renew(other)
    with pytest.raises(LeaseLost, match="another lease"):
        lease_store.release(other)
    assert finish(lease_store, other, "task-b") is False  # the GPU job's release too
    current = lease_store.current(gpu)
    assert (current.token, current.holder) == (lease.token, "job-a")  # left alone
    lease_store.renew(lease)
    lease_store.release(lease)
    assert lease_store.current(gpu) is None


def test_the_worker_mark_refuses_an_old_token_redis_would_take(lease_store, redis_client):
    (gpu,) = add_pool(lease_store)
    k = lease_store.keys
    old = lease_store.try_claim(gpu, "job-old")
    lease_store.check_fence(gpu, old.token, "d-old")
    lease_store.release(old)
    new = lease_store.try_claim(gpu, "job-new")
    lease_store.check_fence(gpu, new.token, "d-new")
    assert lease_store.mark(gpu) == new.token
    # A failover lost the accepted key, and the old lease's write is what the new primary has.
    redis_client.delete(k.accepted(lease_store.pool_of(gpu), gpu))
    redis_client.set(k.lease(lease_store.pool_of(gpu), gpu), f"{old.token}|1|job-old")
    with pytest.raises(StaleToken) as info:
        lease_store.check_fence(gpu, old.token, "d-old")
    assert info.value.current == new.token
    assert (
        redis_client.get(k.accepted(lease_store.pool_of(gpu), gpu)) is None
    )  # refused before any Redis step
    LeaseStore(redis_client, lease_store.prefix).check_fence(gpu, old.token)  # Redis alone: yes

    # The same token again: refused for another delivery, accepted for the same one.
    redis_client.delete(k.accepted(lease_store.pool_of(gpu), gpu))
    redis_client.set(k.lease(lease_store.pool_of(gpu), gpu), f"{new.token}|1|job-new")
    with pytest.raises(StaleToken, match="ran other work"):
        lease_store.check_fence(gpu, new.token, "d-other")
    lease_store.check_fence(gpu, new.token, "d-new")  # repeated after a lost reply
    assert lease_store.mark(gpu) == new.token


def test_the_gpu_job_start_keeps_the_mark(lease_store, redis_client):
    (gpu,) = add_pool(lease_store)
    k = lease_store.keys
    first = lease_store.try_claim(gpu, "task-1")
    running = RunningRecord(lease_store, first, "task-1")
    assert begin(lease_store, first, running) == (STARTED, False)
    assert finish(lease_store, first, "task-1") is True
    second = lease_store.try_claim(gpu, "task-2")
    record = RunningRecord(lease_store, second, "task-2")
    assert begin(lease_store, second, record) == (STARTED, False)
    assert begin(lease_store, second, record) == (STARTED, False)  # after a lost reply
    redis_client.delete(
        k.accepted(lease_store.pool_of(gpu), gpu)
    )  # lost in a failover, with the first job's lease back
    redis_client.set(k.lease(lease_store.pool_of(gpu), gpu), f"{first.token}|1|task-1")
    with pytest.raises(StaleToken):
        begin(lease_store, first, RunningRecord(lease_store, first, "task-1"))
    assert (
        redis_client.get(k.running(lease_store.pool_of(gpu), gpu)) == record.value
    )  # the refused job wrote nothing


def test_after_a_failover_to_a_lagging_clock_the_refused_lease_is_freed_and_the_next_runs(
    lease_store, redis_client, caplog
):
    (gpu,) = add_pool(lease_store)
    k = lease_store.keys
    # The old primary's clock ran ahead of this one's: its tokens are far above our floor.
    redis_client.set(k.fence(lease_store.pool_of(gpu), gpu), server_floor(lease_store) + 10**12)
    first = lease_store.try_claim(gpu, "task-1")
    assert begin(lease_store, first, RunningRecord(lease_store, first, "task-1"))[0] == STARTED
    assert finish(lease_store, first, "task-1") is True
    # Failover: the counter and the accepted key are lost, and the new primary's clock is behind.
    redis_client.delete(
        k.fence(lease_store.pool_of(gpu), gpu), k.accepted(lease_store.pool_of(gpu), gpu)
    )
    behind = lease_store.try_claim(gpu, "task-2")
    assert behind.token < first.token
    with caplog.at_level(logging.WARNING, "gpuhedge_celery.store.leases"):
        with pytest.raises(StaleToken):
            begin(lease_store, behind, RunningRecord(lease_store, behind, "task-2"))
    assert lease_store.current(gpu) is None  # freed now, not when its TTL lapses
    assert lease_store.last_token(gpu) == first.token  # lifted to the worker's mark
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert gpu in line and str(behind.token) in line and str(first.token) in line
    assert (
        redis_client.get(k.running(lease_store.pool_of(gpu), gpu)) is None
    )  # the refused job wrote nothing

    again = lease_store.try_claim(gpu, "task-2")
    assert again.token == first.token + 1  # the clock is still behind: the counter decides
    assert begin(lease_store, again, RunningRecord(lease_store, again, "task-2"))[0] == STARTED
    assert finish(lease_store, again, "task-2") is True
    assert lease_store.mark(gpu) == again.token


def test_a_refusal_whose_lease_cannot_be_freed_is_still_the_refusal(
    lease_store, redis_client, monkeypatch
):
    (gpu,) = add_pool(lease_store)
    k = lease_store.keys
    first = lease_store.try_claim(gpu, "task-1")
    assert begin(lease_store, first, RunningRecord(lease_store, first, "task-1"))[0] == STARTED
    assert finish(lease_store, first, "task-1") is True
    # a lease below the worker's mark, as a failover to a lagging clock leaves it
    older = replace(first, token=first.token - 1, holder="task-2")
    redis_client.set(k.lease(lease_store.pool_of(gpu), gpu), f"{older.token}|1|task-2")
    freeing = []

    def away(*args):
        freeing.append(args)
        raise StoreUnavailable("Redis is unreachable (a failover)")

    monkeypatch.setattr(lease_store, "unblock", away)
    with pytest.raises(StaleToken):  # back to waiting, not a failed request
        begin(lease_store, older, RunningRecord(lease_store, older, "task-2"))
    assert freeing == [(gpu, older.token, "task-2")]  # it did try to free the refused lease


def test_a_number_issued_again_for_another_holder_is_freed_but_a_duplicate_delivery_is_not(
    lease_store, redis_client
):
    (gpu,) = add_pool(lease_store)
    k = lease_store.keys
    lease = lease_store.try_claim(gpu, "task-1")
    running = RunningRecord(lease_store, lease, "task-1")
    assert begin(lease_store, lease, running)[0] == STARTED
    # The broker delivers the running job again (same lease, another delivery): refused, and
    # the lease it runs under is left alone.
    duplicate = RunningRecord(lease_store, lease, "task-1")
    duplicate.value = running.value.rsplit("|", 1)[0] + "|1"
    with pytest.raises(StaleToken):
        begin(lease_store, lease, duplicate)
    assert lease_store.current(gpu).holder == "task-1"
    assert redis_client.get(k.running(lease_store.pool_of(gpu), gpu)) == running.value
    # A failover lost the lease and the counter, and the same number went to another holder.
    redis_client.delete(
        k.accepted(lease_store.pool_of(gpu), gpu), k.running(lease_store.pool_of(gpu), gpu)
    )
    redis_client.set(k.fence(lease_store.pool_of(gpu), gpu), lease.token - 1)
    redis_client.set(k.lease(lease_store.pool_of(gpu), gpu), f"{lease.token}|1|task-2")
    other = replace(lease, holder="task-2")
    with pytest.raises(StaleToken):
        begin(lease_store, other, RunningRecord(lease_store, other, "task-2"))
    assert lease_store.current(gpu) is None
    assert lease_store.last_token(gpu) == lease.token
    assert lease_store.try_claim(gpu, "task-2").token > lease.token


def test_fence_lift_frees_only_the_refused_lease_and_never_lowers_the_counter(
    lease_store, redis_client
):
    (gpu,) = add_pool(lease_store)
    k = lease_store.keys
    lift = lease_store.scripts.fence_lift
    keys = [k.lease(lease_store.pool_of(gpu), gpu), k.fence(lease_store.pool_of(gpu), gpu)]
    redis_client.set(k.lease(lease_store.pool_of(gpu), gpu), "7|1|a|b")  # a holder may contain '|'
    redis_client.set(k.fence(lease_store.pool_of(gpu), gpu), 9)
    assert lift(keys=keys, args=[6, "", 8]) == [0, "9"]  # another token: kept; 9 > 8 stays
    assert lift(keys=keys, args=[7, "a", 8]) == [0, "9"]  # another holder: kept
    assert redis_client.get(k.lease(lease_store.pool_of(gpu), gpu)) == "7|1|a|b"
    assert lift(keys=keys, args=[7, "a|b", 12]) == [1, "12"]
    assert (
        redis_client.get(k.lease(lease_store.pool_of(gpu), gpu)) is None
        and redis_client.get(k.fence(lease_store.pool_of(gpu), gpu)) == "12"
    )
    assert lift(keys=keys, args=[7, "a|b", 12]) == [0, "12"]  # repeated after a lost reply
    big = 1_800_000_000_000_000
    redis_client.delete(k.fence(lease_store.pool_of(gpu), gpu))
    assert lift(keys=keys, args=[1, "", big]) == [0, str(big)]
    assert redis_client.get(k.fence(lease_store.pool_of(gpu), gpu)) == str(
        big
    )  # an integer string, never 1.8e+15
