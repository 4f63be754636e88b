"""The gauges Redis holds, read at scrape time: GPUs per pool and state, waiters, races, timers,
budgets.

These are facts of the whole deployment, not of one process, so no worker counts them: the
``gpuhedge-celery metrics serve`` process reads them from Redis each time Prometheus scrapes it
(a handful of commands, pipelined per slot; one run per scrape, never in the background).

* ``gpuhedge_pool_gpus{pool, state}``: every registered GPU in one of ``free`` (no lease, its
  host heartbeating), ``busy`` (a current lease: ``held`` in ``gpuhedge-celery leases``),
  ``stale`` (leased, but its host stopped heartbeating or its worker accepted a newer token)
  or ``offline`` (no lease and its host is gone). Every state is exported for every pool, zeros
  included, so a query for ``state="busy"`` is 0 rather than absent.
* ``gpuhedge_pool_waiters{pool}``: the pool's FIFO wait queue (waiters that died are dropped
  from it by the next waiter's check).
* ``gpuhedge_races_in_flight``: the live-race indexes of every race shard: races running, plus
  finished races that still have a registered job (a cancel not yet confirmed);
  ``gpuhedge_races_stale``: those whose heartbeat is older than ``stale_s`` (what the janitor
  looks at).
* ``gpuhedge_timers_*{namespace}``: durable timers waiting, overdue (due, not yet claimed), in
  flight (claimed, not acknowledged) and the age of the oldest overdue one: when no worker fires
  timers, the lag histogram has no samples, but this grows.
* ``gpuhedge_budget_{reserved,spent,headroom,cap}_usd{scope, name}``: the rows of
  ``gpuhedge-celery budget`` (:func:`~gpuhedge_celery.store.budget.budget_report`, the same
  code), when the config sets a cap: ``scope`` is ``ceiling``, ``day`` (today, UTC),
  ``provider`` / ``provider_day`` (``name``: each configured provider) and ``key`` /
  ``key_day`` (``name``: each key the config's ``budget.keys`` lists; a key the ledger holds
  but the config does not list is not exported, so the series stay bounded by the config).
  Headroom and cap only for scopes with a cap.
* ``gpuhedge_adaptive_*{policy}``: each adaptive policy's plan as the coordinators last
  published it (``gpuhedge-celery policy show``): its cutover, safety and backup times, its
  hedge and backup providers, the races it learned from and its hedge tokens.

When Redis does not answer, only ``gpuhedge_redis_up 0`` is exported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..core.budget import BudgetCaps, utc_day
from ..core.lease_rules import FREE, HELD, STALE
from ..store.adaptive import AdaptiveStore
from ..store.budget import BudgetStore, budget_report
from ..store.leases import LeaseStore
from ..store.race_keys import RaceShards, timer_keys
from .definitions import REDIS_METRICS

log = logging.getLogger(__name__)

GPU_STATES = ("free", "busy", "stale", "offline")


@dataclass
class Reading:
    """One read of Redis: metric name -> [(label values, value)]."""

    values: dict[str, list[tuple[tuple[str, ...], float]]] = field(default_factory=dict)

    def add(self, name: str, value: float, *labels: str) -> None:
        self.values.setdefault(name, []).append((labels, float(value)))

    def get(self, name: str, *labels: str) -> float | None:
        """One value (for tests and the CLI); None when it was not exported."""
        for found, value in self.values.get(name, []):
            if found == labels:
                return value
        return None


def gpu_state(row: Any) -> str:
    """A lease-table row's state as the gauge names it."""
    if row.state == HELD:
        return "busy"
    if row.state == STALE:
        return "stale"
    if row.state == FREE and not row.host_live:
        return "offline"
    return "free"


class RedisGauges:
    """A ``prometheus_client`` collector reading the deployment's gauges from Redis."""

    def __init__(
        self,
        client: Any,
        prefix: str,
        *,
        namespaces: Iterable[str] | None = None,
        stale_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        budget: BudgetCaps | None = None,
        providers: Iterable[str] = (),
        shards: RaceShards | None = None,
    ):
        self.client = client
        self.prefix = prefix
        self.shards = shards or RaceShards(prefix)  # whose live-race indexes are counted
        # timer namespaces reported: by default every race shard's (where races' timers are)
        self.namespaces = self.shards.tags if namespaces is None else tuple(namespaces)
        self.timer_keys = {ns: timer_keys(prefix, ns) for ns in self.namespaces}
        self.stale_s = float(stale_s)
        self.clock = clock
        self.leases = LeaseStore(client, prefix)
        self.budget = budget if budget is not None and budget.enabled else None
        self.providers = list(providers)
        self.ledger = BudgetStore(client, prefix) if self.budget is not None else None
        self.adaptive = AdaptiveStore(client, prefix)

    def read(self) -> Reading:
        """Read every gauge (raises the store's error when Redis does not answer)."""
        reading = Reading()
        rows = self.leases.table()
        pools = sorted(set(self.leases.pools()) | {r.pool for r in rows})
        counts = {(pool, state): 0 for pool in pools for state in GPU_STATES}
        for row in rows:
            counts[(row.pool, gpu_state(row))] += 1
        for (pool, state), n in sorted(counts.items()):
            reading.add("gpuhedge_pool_gpus", n, pool, state)
        for pool in pools:
            reading.add("gpuhedge_pool_waiters", len(self.leases.queue(pool)), pool)
        now_ms = int(self.clock() * 1000)
        cutoff = now_ms - int(self.stale_s * 1000)
        # one pipeline per hash tag: a shard's live index and its namespace's timers share one
        live_of = {index.tag: index.live for index in self.shards.indexes}
        tags = dict.fromkeys([*live_of, *self.namespaces])
        answers: dict[str, list[Any]] = {}
        with self.leases.guard():
            for tag in tags:
                pipe = self.client.pipeline(transaction=False)
                if tag in live_of:
                    pipe.zcard(live_of[tag])
                    pipe.zcount(live_of[tag], "-inf", cutoff)
                if tag in self.timer_keys:
                    keys = self.timer_keys[tag]
                    pipe.zcard(keys.due)
                    pipe.zcount(keys.due, "-inf", now_ms)
                    pipe.zcard(keys.inflight)
                    pipe.zrange(keys.due, 0, 0, withscores=True)
                answers[tag] = pipe.execute()
        in_flight = stale = 0
        for tag in live_of:
            in_flight, stale = in_flight + answers[tag][0], stale + answers[tag][1]
        reading.add("gpuhedge_races_in_flight", in_flight)
        reading.add("gpuhedge_races_stale", stale)
        for ns in self.namespaces:
            due, overdue, inflight, first = answers[ns][-4:]
            reading.add("gpuhedge_timers_pending", due, ns)
            reading.add("gpuhedge_timers_overdue", overdue, ns)
            reading.add("gpuhedge_timers_in_flight", inflight, ns)
            oldest = 0.0
            if first and float(first[0][1]) < now_ms:
                oldest = (now_ms - float(first[0][1])) / 1000.0
            reading.add("gpuhedge_timer_oldest_overdue_seconds", oldest, ns)
        self._read_budget(reading)
        self._read_adaptive(reading)
        return reading

    def _read_adaptive(self, reading: Reading) -> None:
        """Each adaptive policy's published plan and hedge budget (``policy show``)."""
        for name in self.adaptive.policies():
            counts = self.adaptive.counts(name)
            learned = counts.get("plan") or {}
            plan = learned.get("plan") or {}
            for timer in ("cutover", "safety", "backup"):
                value = plan.get(f"{timer}_s")
                if value is not None and plan.get("hedge") is not None:
                    reading.add("gpuhedge_adaptive_plan_seconds", float(value), name, timer)
            for role in ("hedge", "backup"):
                if plan.get(role) is not None:
                    reading.add("gpuhedge_adaptive_provider", 1.0, name, role, plan[role])
            reading.add("gpuhedge_adaptive_races_learned", float(learned.get("races", 0)), name)
            if counts.get("tokens") is not None:
                reading.add("gpuhedge_adaptive_hedge_tokens", counts["tokens"], name)

    def _read_budget(self, reading: Reading) -> None:
        """The budget rows of ``gpuhedge-celery budget`` for today, as gauges (when capped)."""
        if self.ledger is None or self.budget is None:
            return
        day = utc_day(self.clock())
        report = budget_report(self.ledger, self.budget, self.providers, day, seen_keys=False)
        for row in report["rows"]:
            labels = (row["kind"], row["name"])
            reading.add("gpuhedge_budget_reserved_usd", row["reserved_usd"], *labels)
            reading.add("gpuhedge_budget_spent_usd", row["spent_usd"], *labels)
            if row["cap_usd"] is not None:
                reading.add("gpuhedge_budget_cap_usd", row["cap_usd"], *labels)
                reading.add("gpuhedge_budget_headroom_usd", row["headroom_usd"], *labels)
        for provider, count in report["over_reported"].items():
            reading.add("gpuhedge_budget_over_reported_settlements", count, provider)

    # -- the prometheus_client Collector interface -------------------------------------------
    def describe(self) -> Iterator[Any]:
        """The families without values (so registering the collector reads nothing)."""
        return iter(self._families(Reading()))

    def collect(self) -> Iterator[Any]:
        try:
            reading = self.read()
        except Exception as e:  # a scrape must answer; say that Redis did not
            log.warning("metrics: reading Redis failed: %s", e)
            up = Reading()
            up.add("gpuhedge_redis_up", 0)
            return iter(self._families(up, only_up=True))
        reading.add("gpuhedge_redis_up", 1)
        return iter(self._families(reading))

    def _families(self, reading: Reading, *, only_up: bool = False) -> list[Any]:
        from prometheus_client.core import GaugeMetricFamily

        families = []
        for spec in REDIS_METRICS:
            if only_up and spec.name != "gpuhedge_redis_up":
                continue
            family = GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))
            for labels, value in reading.values.get(spec.name, []):
                family.add_metric(list(labels), value)
            families.append(family)
        return families
