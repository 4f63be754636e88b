"""Every metric this package exports: name, type, help, labels, buckets (plain data).

Names follow Prometheus's conventions: a ``gpuhedge_`` prefix, base units in the name
(``_seconds``, ``_usd``), ``_total`` on counters, histograms for latencies, and labels whose
values come from small sets (a provider or pool name from the config, a policy kind, a fixed
reason): never a race, task, job or GPU-lease id.

``source`` says who exports it: ``worker`` (counted in the process where it happens, served
by the worker's endpoint) or ``redis`` (read from Redis at scrape time by
``gpuhedge-celery metrics serve``).
"""

from __future__ import annotations

from dataclasses import dataclass

COUNTER, HISTOGRAM, GAUGE = "counter", "histogram", "gauge"
WORKER, REDIS = "worker", "redis"

# Latency buckets (seconds). A race waits on its providers for seconds to minutes; the
# coordinator's own work (timer lag, overhead, handoff) is milliseconds.
RACE_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300)
FAST_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
WAIT_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600)


@dataclass(frozen=True)
class MetricSpec:
    """One metric. ``name`` is the family name (a counter's samples end in ``_total``)."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    source: str = WORKER

    def samples(self) -> tuple[str, ...]:
        """The sample names Prometheus stores for this metric."""
        if self.kind == COUNTER:
            return (self.name + "_total",)
        if self.kind == HISTOGRAM:
            return (self.name + "_bucket", self.name + "_sum", self.name + "_count")
        return (self.name,)


def _c(name: str, help: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, COUNTER, help, labels)


def _h(name: str, help: str, buckets: tuple[float, ...], *labels: str) -> MetricSpec:
    return MetricSpec(name, HISTOGRAM, help, labels, buckets)


def _g(name: str, help: str, *labels: str) -> MetricSpec:
    return MetricSpec(name, GAUGE, help, labels, source=REDIS)


# fmt: off
WORKER_METRICS: tuple[MetricSpec, ...] = (
    # -- races (counted by the coordination worker that performs the step) --------------------
    _c("gpuhedge_races_started", "Hedged races created.", "policy"),
    _c("gpuhedge_races_won", "Races decided, by the winning provider and its role.",
       "provider", "role"),
    _c("gpuhedge_races_failed", "Races that ended without a valid result, by reason.", "reason"),
    _c("gpuhedge_races_hedged", "Races whose hedge was sent to its provider.", "policy"),
    _c("gpuhedge_races_cut_over", "Races that decided to cancel a still-queued primary.", "policy"),
    _c("gpuhedge_races_escalated", "Races whose fallback was sent to its provider.", "policy"),
    _h("gpuhedge_race_e2e_seconds", "From the race's creation to its valid result being known.",
       RACE_S, "policy"),
    _h("gpuhedge_race_overhead_seconds",
       "The winning attempt's launch-to-result time minus its provider's own wall time.",
       FAST_S),
    _c("gpuhedge_race_losers_cancelled",
       "Losing attempts whose cancel was sent, by the evidence that they stopped (at race end).",
       "provider", "evidence"),
    _c("gpuhedge_race_leaks", "Cancels that could not be confirmed (the job may still bill).",
       "provider"),
    _c("gpuhedge_race_billed_usd", "Dollars billed for races' jobs (idle windows included)."),
    _c("gpuhedge_race_wasted_usd", "Dollars of active time spent on attempts that did not win."),
    # -- budgets -------------------------------------------------------------------------------
    _c("gpuhedge_budget_refusals",
       "Attempts not submitted because the budget refused their reservation, by the kind of "
       "cap that refused (request, ceiling, day, provider, key) and the attempt's role.",
       "cap", "role"),
    # -- timers ------------------------------------------------------------------------------
    _h("gpuhedge_timer_lag_seconds", "From a durable timer's due time to its handler starting.",
       FAST_S, "kind"),
    _c("gpuhedge_timers_batched",
       "Due timers given to the batched coordination loop (race/watch_batch.py), by "
       "whether it finished them or handed them back to a timer thread.", "outcome"),
    # -- GPU pool and leases -------------------------------------------------------------------
    _h("gpuhedge_pool_wait_seconds", "A pooled request's wait in the FIFO queue for a GPU lease.",
       WAIT_S, "pool"),
    _c("gpuhedge_pool_wait_timeouts",
       "Pooled requests that stopped waiting without a GPU (timeout or cancel).", "pool"),
    _h("gpuhedge_pool_handoff_seconds",
       "From a lease granted on the coordinator to its job starting on the GPU's worker.",
       FAST_S, "pool"),
    _c("gpuhedge_leases_lost", "GPU leases a job lost or was refused, by stage.", "pool", "stage"),
    _c("gpuhedge_reconcile_corrections",
       "Lease corrections by the reconcile pass (restore: a GPU busy without a lease).", "kind"),
    # -- janitor -----------------------------------------------------------------------------
    _c("gpuhedge_janitor_actions", "What the race janitor did to stale races.", "action"),
    _c("gpuhedge_janitor_cancels", "Native cancels made by the janitor, by outcome.", "outcome"),
    # -- providers ---------------------------------------------------------------------------
    _c("gpuhedge_provider_requests", "Calls to a provider's job API.", "provider", "route"),
    _c("gpuhedge_provider_errors", "Failed calls to a provider's job API, by kind (rate_limited "
       "is HTTP 429).", "provider", "route", "kind"),
    _h("gpuhedge_cancel_token_wait_seconds",
       "How long a loser's cancel waited for the fleet's rate-limit token before it was sent.",
       (0.0, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0), "provider"),
    # -- Redis replicas (GPUHEDGE_REDIS_WAIT_REPLICAS) -----------------------------------------
    _c("gpuhedge_replica_wait_short",
       "WAITs after a winner claim, a budget reservation or a race's failing save that fewer "
       "replicas than asked "
       "acknowledged, by what was written and whether it was sent again or left to a retry.",
       "what", "outcome"),
)

REDIS_METRICS: tuple[MetricSpec, ...] = (
    _g("gpuhedge_redis_up", "1 when the last read of Redis succeeded, else 0."),
    _g("gpuhedge_pool_gpus", "Registered GPUs by lease state: free, busy, stale, offline.",
       "pool", "state"),
    _g("gpuhedge_pool_waiters", "Requests queued for a GPU of the pool.", "pool"),
    _g("gpuhedge_races_in_flight", "Races in the live index (running, or with a live job)."),
    _g("gpuhedge_races_stale", "Races whose heartbeat is older than the janitor's threshold."),
    _g("gpuhedge_timers_pending", "Durable timers waiting for their due time or a claim.",
       "namespace"),
    _g("gpuhedge_timers_overdue", "Durable timers past their due time and not claimed yet.",
       "namespace"),
    _g("gpuhedge_timers_in_flight", "Durable timers claimed and not acknowledged yet.",
       "namespace"),
    _g("gpuhedge_budget_cap_usd", "A budget cap, per scope (what `gpuhedge-celery budget` "
       "shows; only capped scopes).", "scope", "name"),
    _g("gpuhedge_budget_reserved_usd", "Dollars reserved (worst cases of attempts not settled "
       "yet), per budget scope.", "scope", "name"),
    _g("gpuhedge_budget_spent_usd", "Dollars spent (settled), per budget scope.",
       "scope", "name"),
    _g("gpuhedge_budget_headroom_usd", "A cap minus reserved and spent, per capped budget scope "
       "(negative when over).", "scope", "name"),
    _g("gpuhedge_budget_over_reported_settlements",
       "Settlements whose reported cost was above the attempt's reservation (its worst case), "
       "counted by the settling script since the ledger began; each settled at the reservation.",
       "provider"),
    _g("gpuhedge_adaptive_plan_seconds",
       "An adaptive policy's current plan: when it polls the primary to cut over, hedges "
       "beside it, or brings the backup in (timer: cutover, safety, backup; absent: never).",
       "policy", "timer"),
    _g("gpuhedge_adaptive_provider",
       "1 for the provider an adaptive policy's current plan uses as its hedge or backup.",
       "policy", "role", "provider"),
    _g("gpuhedge_adaptive_races_learned",
       "Finished races the adaptive policy's current plan was learned from.", "policy"),
    _g("gpuhedge_adaptive_hedge_tokens",
       "Tokens left in an adaptive policy's hedge budget (only with a budget).", "policy"),
    _g("gpuhedge_timer_oldest_overdue_seconds",
       "How long the oldest unclaimed overdue timer has been due (0 when none is).",
       "namespace"),
)
# fmt: on

ALL_METRICS = WORKER_METRICS + REDIS_METRICS
BY_NAME = {m.name: m for m in ALL_METRICS}


def sample_names() -> set[str]:
    """Every sample name a scrape of this package's endpoints can show."""
    return {sample for m in ALL_METRICS for sample in m.samples()}
