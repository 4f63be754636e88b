"""The gauges ``metrics serve`` reads from a real redis-server: GPUs by state, waiters, races,
timers, budgets, and what a scrape shows when Redis does not answer."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuhedge_celery.core.attempts import Attempt
from gpuhedge_celery.core.budget import BudgetCaps, ScopeCap, to_nano, to_usd, utc_day
from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.errors import AcquireTimeout
from gpuhedge_celery.metrics.definitions import REDIS_METRICS
from gpuhedge_celery.metrics.redis_gauges import RedisGauges
from gpuhedge_celery.race.budget import RaceBudget
from gpuhedge_celery.store.budget import BudgetStore, budget_report
from gpuhedge_celery.store.race_keys import shard_indexes
from gpuhedge_celery.store.timers import TimerStore
from gpuhedge_celery.store.waiter import LeaseWaiter
from tests.support.fixtures_leases import add_pool, wait_until
from tests.support.redis_server import free_port

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


def scraped(collector: RedisGauges) -> dict[tuple[str, tuple], float]:
    """The collector as Prometheus would read it: text format, parsed by the library."""
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_gpus_by_state_waiters_races_and_timers(lease_store, redis_client, prefix):
    add_pool(lease_store, "a", 2, host="h1")  # h1:0 busy, h1:1 free
    add_pool(lease_store, "a", 2, host="h2", heartbeat_ms=300)  # h2:0 leased, then its host dies
    add_pool(lease_store, "b", 1, host="h3")
    assert lease_store.try_claim("h1:0", "job-1") is not None
    assert lease_store.try_claim("h2:0", "job-2") is not None
    assert lease_store.try_claim("h3:0", "job-3") is not None
    # one request waits in pool b's queue (for real: a waiter blocked in acquire)
    waiter = LeaseWaiter(lease_store, recheck_s=0.2)
    gave_up = threading.Event()

    def wait() -> None:
        try:
            waiter.acquire("b", "queued-1", timeout_s=10)
        except AcquireTimeout:
            gave_up.set()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    assert wait_until(lambda: lease_store.queue("b") == ["queued-1"], 5)
    now = time.time()
    timers = TimerStore(redis_client, prefix, "races")
    timers.arm("late", int((now - 2.0) * 1000), {"kind": "policy"})
    timers.arm("later", int((now + 60) * 1000), {"kind": "policy"})
    live = shard_indexes(prefix, "races").live
    redis_client.zadd(live, {"r-fresh": int(now * 1000), "r-old": int((now - 60) * 1000)})
    assert wait_until(lambda: not lease_store.host_live("h2"), 5)

    got = scraped(RedisGauges(redis_client, prefix, stale_s=30))

    def gpus(pool: str, state: str) -> float:
        return got[("gpuhedge_pool_gpus", (("pool", pool), ("state", state)))]

    assert got[("gpuhedge_redis_up", ())] == 1
    assert [gpus("a", s) for s in ("free", "busy", "stale", "offline")] == [1, 1, 1, 1]
    assert [gpus("b", s) for s in ("free", "busy", "stale", "offline")] == [0, 1, 0, 0]
    assert got[("gpuhedge_pool_waiters", (("pool", "a"),))] == 0
    assert got[("gpuhedge_pool_waiters", (("pool", "b"),))] == 1
    assert got[("gpuhedge_races_in_flight", ())] == 2
    assert got[("gpuhedge_races_stale", ())] == 1
    ns = (("namespace", "races"),)
    assert got[("gpuhedge_timers_pending", ns)] == 2
    assert got[("gpuhedge_timers_overdue", ns)] == 1
    assert got[("gpuhedge_timers_in_flight", ns)] == 0
    assert 2.0 <= got[("gpuhedge_timer_oldest_overdue_seconds", ns)] < 10.0
    exported = {name for name, _ in got}
    budget_gauges = {m.name for m in REDIS_METRICS if m.name.startswith("gpuhedge_budget_")}
    adaptive = {m.name for m in REDIS_METRICS if m.name.startswith("gpuhedge_adaptive_")}
    # no budget configured, no adaptive policy planned a race
    assert exported == {m.name for m in REDIS_METRICS} - budget_gauges - adaptive

    # the GPU frees: the waiter takes it, and the next read says so
    lease_store.force_release("h3:0")
    thread.join(10)
    assert not gave_up.is_set()
    again = RedisGauges(redis_client, prefix).read()
    assert again.get("gpuhedge_pool_waiters", "b") == 0
    assert again.get("gpuhedge_pool_gpus", "b", "busy") == 1  # now the waiter's lease


def test_unreachable_redis_is_up_0_and_nothing_else(prefix):
    dead = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5)
    got = scraped(RedisGauges(dead, prefix))
    assert got == {("gpuhedge_redis_up", ()): 0}


def test_registering_the_collector_reads_nothing(prefix):
    dead = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5)
    collector = RedisGauges(dead, prefix)
    collector.read = lambda: pytest.fail("registering the collector read Redis")
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)  # describe() only
    assert [f.name for f in collector.describe()] == [m.name for m in REDIS_METRICS]


# one attempt of p: 100 s at $0.001/s plus 20 s idle; of h: 50 s at $0.002/s
SPEC = {
    "caps_s": {"p": 100.0, "h": 50.0},
    "rates": {"p": {"rate_per_s": 0.001, "idle_s": 20.0}, "h": {"rate_per_s": 0.002, "idle_s": 0}},
}
NOW = 1_900_000_000.0


def test_budget_gauges_after_reserving_and_settling(redis_client, prefix):
    caps = BudgetCaps(
        ceiling_usd=1.0, max_usd_per_day=0.5,
        providers={"p": ScopeCap(max_usd_per_day=0.3)},
        keys={"team-a": ScopeCap(max_usd_total=0.4), "*": ScopeCap(max_usd_total=0.2)},
    )  # fmt: skip
    ledger = BudgetStore(redis_client, prefix)
    rb = RaceBudget(ledger, caps, VirtualClock(NOW))

    def reserve(race_id: str, aid: str, provider: str, key: str | None) -> int:
        a = Attempt(id=aid, provider=provider, role="primary", launched_at=0.0)
        found = ledger.reserve(rb.reservation(race_id, a, {"spec": {**SPEC, "budget_key": key}}))
        assert found.granted
        return found.amount_nano

    p_worst = reserve("r1", "a1", "p", "team-a")
    h_worst = reserve("r2", "a1", "h", "someone-else")  # a key only "*" lets in
    spent = to_nano(0.05)
    assert ledger.settle("r1", [("a1", spent, "billed")], int(NOW * 1000)) == (1, spent)

    gauges = RedisGauges(redis_client, prefix, clock=lambda: NOW, budget=caps,
                         providers=["p", "h"])  # fmt: skip
    got = scraped(gauges)

    def g(metric: str, scope: str, name: str = "") -> float | None:
        return got.get((f"gpuhedge_budget_{metric}_usd", (("name", name), ("scope", scope))))

    both = to_usd(h_worst)  # reserved: h's worst case; spent: what p's attempt settled to
    for scope in ("ceiling", "day"):
        assert g("reserved", scope) == pytest.approx(both)
        assert g("spent", scope) == pytest.approx(to_usd(spent))
    assert g("cap", "ceiling") == 1.0 and g("cap", "day") == 0.5
    assert g("headroom", "ceiling") == pytest.approx(1.0 - to_usd(h_worst + spent))
    assert g("headroom", "day") == pytest.approx(0.5 - to_usd(h_worst + spent))
    assert g("spent", "provider_day", "p") == pytest.approx(to_usd(spent))
    assert g("headroom", "provider_day", "p") == pytest.approx(0.3 - to_usd(spent))
    assert g("reserved", "provider", "h") == pytest.approx(to_usd(h_worst))
    assert g("cap", "provider", "h") is None  # h has no cap: no cap, no headroom
    assert g("headroom", "provider", "h") is None
    assert g("headroom", "key", "team-a") == pytest.approx(0.4 - to_usd(spent))
    assert p_worst > spent  # settling released the rest of p's reservation
    # keys only "*" lets in are not exported: the series stay bounded by the config
    assert not [k for k in got if ("name", "someone-else") in k[1]]
    # the same figures as `gpuhedge-celery budget` (one code path)
    report = budget_report(ledger, caps, ["p", "h"], utc_day(NOW))
    day_row = next(r for r in report["rows"] if r["kind"] == "day")
    assert g("headroom", "day") == day_row["headroom_usd"]
