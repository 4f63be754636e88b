"""The hooks the rest of the package calls, one line per event: ``record.race_started(race)``.

Each hook costs a few microseconds: a counter or histogram of ``prometheus_client`` updated in
this process (in prefork workers, a write to the process's memory-mapped file). Nothing here
opens a connection or a file at import; the metrics are built on the first hook that runs.

Metrics are off, and every hook returns at once, when ``prometheus_client`` is not installed
(``pip install 'gpuhedge-celery[metrics]'``) or ``GPUHEDGE_METRICS`` is ``0``/``false``/``off``.
They register in ``prometheus_client``'s default registry, so a process that already serves it
exports them too; Celery workers serve them with :mod:`.exposition`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from .. import settings
from ..core.budget import cap_kind
from ..envvars import METRICS_OFF, metrics_enabled
from .definitions import COUNTER, HISTOGRAM, WORKER_METRICS

OFF_VALUES = METRICS_OFF

# failure reasons of a race without a winner (a small fixed set: a label's values)
INVALID, TIMEOUT, SUBMIT_FAILED, PROVIDER_FAILED, OTHER = (
    "invalid_result",
    "timeout",
    "submit_failed",
    "provider_failed",
    "other",
)
TIMER_KINDS = frozenset({"policy", "watch", "cancel", "launch"})
ERROR_KINDS = frozenset({"timeout", "connection", "rate_limited", "http", "protocol", "rejected"})

_lock = threading.Lock()
_metrics: Any = None  # None: not decided yet; False: off; else a _Metrics


class _Metrics:
    """The ``prometheus_client`` objects of :data:`WORKER_METRICS`, as attributes, and
    :meth:`child`, which keeps each label set's child (``labels()`` takes a lock per call)."""

    def __init__(self, prom: Any):
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}
        if hasattr(prom, "disable_created_metrics"):
            prom.disable_created_metrics()  # no *_created series: less to store and to scrape
        for spec in WORKER_METRICS:
            short = spec.name.removeprefix("gpuhedge_")
            if spec.kind == COUNTER:
                metric = prom.Counter(spec.name, spec.help, spec.labels)
            elif spec.kind == HISTOGRAM:
                metric = prom.Histogram(spec.name, spec.help, spec.labels, buckets=spec.buckets)
            else:  # pragma: no cover - workers export counters and histograms only
                raise ValueError(f"{spec.name}: a worker metric must not be a {spec.kind}")
            setattr(self, short, metric)

    def child(self, name: str, *labels: str) -> Any:
        key = (name, labels)
        found = self._children.get(key)
        if found is None:  # two threads may both build it: labels() returns the same child
            found = self._children[key] = getattr(self, name).labels(*labels)
        return found


def enabled_by_env(environ: Any = None) -> bool:
    """Whether ``GPUHEDGE_METRICS`` leaves metrics on (the default): this process's settings,
    or those of ``environ``."""
    if environ is None:
        return settings.current().metrics_enabled
    return metrics_enabled(environ)


def _load() -> Any:
    global _metrics
    with _lock:
        if _metrics is None:
            built: Any = False
            if enabled_by_env():
                try:
                    import prometheus_client
                except ImportError:
                    pass
                else:
                    built = _Metrics(prometheus_client)
            _metrics = built  # only once complete: other threads read it without the lock
        return _metrics


def active() -> bool:
    """Whether hooks record anything in this process (builds the metrics on first call)."""
    return bool(_metrics if _metrics is not None else _load())


def _m() -> Any:
    m = _metrics
    return m if m is not None else _load()


# ---------------------------------------------------------------------- races
def race_started(race: Any) -> None:
    """A race was created (``race``: the engine's Race)."""
    m = _m()
    if m:
        m.child("races_started", race.policy.kind).inc()


def race_event(name: str, race: Any, attempt: Any) -> None:
    """A lifecycle moment the driver also announces to Flower (hedge launched, leaked...)."""
    m = _m()
    if not m:
        return
    if name == "hedge_launched":
        m.child("races_hedged", race.policy.kind).inc()
    elif name == "escalated":
        m.child("races_escalated", race.policy.kind).inc()
    elif name == "cut_over":
        m.child("races_cut_over", race.policy.kind).inc()
    elif name == "leaked" and attempt is not None:
        m.child("race_leaks", attempt.provider).inc()


def race_won(race: Any, result: dict[str, Any] | None) -> None:
    """The race's winner was declared; ``result`` is the caller's result (None: not ours)."""
    m = _m()
    won = race.winner_attempt
    if not m or won is None or result is None or won.result_at is None:
        return
    m.child("races_won", won.provider, won.role).inc()
    m.child("race_e2e_seconds", race.policy.kind).observe(won.result_at)
    provider_ms = result.get("provider_ms")
    if isinstance(provider_ms, (int, float)) and not isinstance(provider_ms, bool):
        own = won.result_at - won.launched_at - provider_ms / 1000.0
        m.race_overhead_seconds.observe(max(0.0, own))


def race_finished(race: Any, receipt: dict[str, Any]) -> None:
    """Every attempt settled and the receipt was assembled: failures, dollars, cancels."""
    m = _m()
    if not m:
        return
    if race.winner is None:
        m.child("races_failed", failure_reason(race.attempts)).inc()
    billed, wasted = receipt.get("billed_usd"), receipt.get("wasted_usd")
    if billed:
        m.race_billed_usd.inc(billed)
    if wasted:
        m.race_wasted_usd.inc(wasted)
    for a in race.attempts:
        if a.id != race.winner and a.cancel_sent_at is not None and a.receipt is not None:
            m.child("race_losers_cancelled", a.provider, a.receipt.evidence.value).inc()


def failure_reason(attempts: Iterable[Any]) -> str:
    """Why a race without a winner failed, as one of a few fixed words (a label value)."""
    attempts = list(attempts)
    states = {a.result_state for a in attempts}
    if any(a.result_state == "COMPLETED" and not a.valid for a in attempts):
        return INVALID
    if "TIMEOUT" in states:
        return TIMEOUT
    if attempts and all(a.submitted_at is None for a in attempts):
        return SUBMIT_FAILED
    if "FAILED" in states:
        return PROVIDER_FAILED
    return OTHER


# ---------------------------------------------------------------------- budgets
def budget_refused(cap: str, role: str) -> None:
    """The budget refused an attempt's reservation (``cap``: the refusing cap's name, counted
    by its kind only; ``role``: primary, hedge or fallback): it was not submitted."""
    m = _m()
    if m:
        m.child("budget_refusals", cap_kind(cap), role).inc()


# ---------------------------------------------------------------------- timers
def timer_fired(payload: Any, lag_s: float) -> None:
    """A durable timer's handler starts ``lag_s`` after its due time."""
    m = _m()
    if m:
        kind = payload.get("kind") if isinstance(payload, dict) else None
        m.child("timer_lag_seconds", kind if kind in TIMER_KINDS else "other").observe(
            max(0.0, lag_s)
        )


def timers_batched(done: int, handed_back: int) -> None:
    """The batched coordination loop finished ``done`` timers of a batch together and handed
    ``handed_back`` to the timer threads."""
    m = _m()
    if m:
        if done:
            m.child("timers_batched", "done").inc(done)
        if handed_back:
            m.child("timers_batched", "handed_back").inc(handed_back)


# ---------------------------------------------------------------------- pool and leases
def pool_waited(pool: str, seconds: float) -> None:
    """A pooled request got a GPU lease after ``seconds`` in the queue."""
    m = _m()
    if m:
        m.child("pool_wait_seconds", pool).observe(max(0.0, seconds))


def pool_wait_gave_up(pool: str) -> None:
    """A pooled request stopped waiting without a GPU: its timeout, or it was cancelled."""
    m = _m()
    if m:
        m.child("pool_wait_timeouts", pool).inc()


def pool_handoff(pool: str, seconds: float) -> None:
    """A leased job started on its GPU's worker ``seconds`` after the lease was granted."""
    m = _m()
    if m:
        m.child("pool_handoff_seconds", pool).observe(max(0.0, seconds))


def lease_lost(pool: str, stage: str) -> None:
    """A job lost its lease (``running``, ``release``) or was refused it (``fence``)."""
    m = _m()
    if m:
        m.child("leases_lost", pool, stage).inc()


def reconcile_corrected(kind: str) -> None:
    """The reconcile pass freed (``free``) or restored (``restore``) a lease, or found a
    ``conflict`` it only reports."""
    m = _m()
    if m:
        m.child("reconcile_corrections", kind).inc()


# ---------------------------------------------------------------------- janitor
def janitor_pass(races: Iterable[Any]) -> None:
    """What one janitor pass did (``races``: its RaceCleanup records)."""
    m = _m()
    if not m:
        return
    for cleanup in races:
        action = cleanup.action.split(":", 1)[0]  # "skipped: <why>" -> "skipped"
        m.child("janitor_actions", action).inc()
        if cleanup.cancelled:
            m.child("janitor_cancels", "confirmed").inc(len(cleanup.cancelled))
        if cleanup.leaked:
            m.child("janitor_cancels", "unconfirmed").inc(len(cleanup.leaked))


# ---------------------------------------------------------------------- providers
def provider_call(provider: str, route: str, error: str | None = None) -> None:
    """One call to a provider's job API (``route``: submit, status, result, cancel...).

    ``error``: None for a success, else its kind: ``rate_limited`` (HTTP 429), ``http`` (any
    other error status), ``timeout``, ``connection``, ``protocol`` (an answer we could not
    read) or ``rejected`` (refused without an HTTP status). Adapters call this once per call.
    """
    m = _m()
    if not m:
        return
    m.child("provider_requests", provider, route).inc()
    if error is not None:
        kind = error if error in ERROR_KINDS else "other"
        m.child("provider_errors", provider, route, kind).inc()


def cancel_token_wait(provider: str, seconds: float) -> None:
    """How long one cancel waited for its rate-limit token (0: sent at once)."""
    m = _m()
    if m:
        m.child("cancel_token_wait_seconds", provider).observe(max(0.0, seconds))


# ---------------------------------------------------------------------- Redis replicas
def replica_wait_short(what: str, outcome: str) -> None:
    """A ``WAIT`` after a ``winner`` claim, a ``reservation`` or a race's ``failure`` (the
    save that failed it) came back with fewer replicas than asked: the write is sent again
    (``retried``) or its step left to a retry (``gave_up``)."""
    m = _m()
    if m:
        m.child("replica_wait_short", what, outcome).inc()


def http_error_kind(status: int) -> str:
    """The error kind of an HTTP error status (429 is the provider's rate limit)."""
    return "rate_limited" if status == 429 else "http"
