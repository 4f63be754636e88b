"""The ``sim`` adapter: a deterministic serverless GPU provider that needs no account.

Each job's fate is drawn once, at submit, from ``random.Random("<seed>:<key>")`` (the key is the
request's ``sim_key`` when given, else the provider's submit counter): a fast or slow mode
(bimodal queue and run times), then an outcome (valid, invalid = a near-silent WAV, failed). The
draws go into ``handle.extra["sim"]``, so the job's state at any moment is a pure function of
the handle, the clock and a tiny shared :class:`SimLedger` that records cancellations. Any
process holding the handle computes the same QUEUED -> IN_PROGRESS -> COMPLETED timeline.

``time_scale`` compresses the wall clock: with 0.01, a 10 s provider-time job takes 0.1 s of
real time. Costs and provider metrics stay in provider time.

Tests and demos may force a job's fate per provider with ``request["sim"][<provider name>]``,
e.g. ``{"queue_s": 20, "run_s": 5, "outcome": "invalid"}`` (outcome ``submit_error`` makes
``submit`` raise, ``rate_limited`` makes it raise as an HTTP 429 would; ``cancel_ack_s`` /
``cancel_terminal_s`` make this job's cancel slow, so it can still complete, and win, while
its cancel is unconfirmed; ``submit_s`` makes the submit call itself take that long, like a
slow job API: the request is counted when the call starts and the job exists when it returns).
"""

from __future__ import annotations

import base64
import functools
import json
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.jobs import AttemptResult, JobHandle, JobState, LifecycleEvent
from ..core.receipts import CancelReceipt, CancelScope, Evidence
from ..core.validators import tone_wav
from ..errors import SubmitError
from ..metrics import record as metrics
from . import account_checks
from .account import LoginCheck, SpendReport
from .base import Provider
from .options import Block
from .simledger import (
    LEDGER_TTL_S,
    MemoryLedger,
    RedisLedger,
    SimLedger,
    cancel_key,
    done_key,
    get_default_ledger,
    seq_key,
    set_default_ledger,
)
from .simspec import SimSpec

if TYPE_CHECKING:
    from .provider_config import ProviderConfig

OUTCOMES = ("ok", "invalid", "failed", "submit_error", "rate_limited")
# per-request overrides of a job's fate (tests, demos): request["sim"][provider] = {...}
_OVERRIDES = (
    "queue_s",
    "run_s",
    "outcome",
    "slow",
    "cancel_ack_s",
    "cancel_terminal_s",
    "submit_s",
)

__all__ = [
    "OUTCOMES",
    "MemoryLedger",
    "RedisLedger",
    "SimLedger",
    "SimProvider",
    "SimSpec",
    "cancel_key",
    "done_key",
    "get_default_ledger",
    "seq_key",
    "set_default_ledger",
]


@functools.lru_cache(maxsize=16)
def _audio_b64(seconds: float, sample_rate: int, silent: bool) -> str:
    amplitude = 1e-6 if silent else 0.3  # 1e-6 rounds to digital silence: RMS 0 < 1e-4
    return base64.b64encode(tone_wav(seconds, sample_rate, amplitude)).decode("ascii")


_UNREAD = object()  # _view: the cancel record was not read yet


@dataclass(frozen=True)
class _Fate:
    """A sim job's drawn fate, read back from ``handle.extra['sim']``."""

    key: str
    slow: bool
    queue_s: float
    run_s: float
    outcome: str
    time_scale: float

    @property
    def end_s(self) -> float:
        return self.queue_s + self.run_s

    @classmethod
    def of(cls, handle: JobHandle) -> _Fate:
        d = handle.extra["sim"]
        return cls(
            str(d["key"]),
            bool(d["slow"]),
            float(d["queue_s"]),
            float(d["run_s"]),
            str(d["outcome"]),
            float(d["time_scale"]),
        )


@dataclass(frozen=True)
class _View:
    """The job as seen at one moment: state, and when (epoch s) it became terminal, if it did."""

    state: JobState
    terminal_at: float | None
    cancel: dict[str, float] | None
    started: bool
    execution_s: float = 0.0  # provider-time seconds run so far (what is billed)


class SimProvider(Provider):
    """A simulated serverless provider with seeded bimodal latency; see the module docstring."""

    adapter = "sim"
    spends_money = False  # simulated: no account, no bill

    def __init__(
        self,
        name: str,
        spec: SimSpec | None = None,
        *,
        ledger: SimLedger | None = None,
        **kwargs: Any,
    ):
        super().__init__(name, **kwargs)
        self.spec = spec or SimSpec()
        self._ledger = ledger

    @classmethod
    def parse_options(cls, block: Block, *, time_scale: float | None = None) -> SimSpec:
        return SimSpec.from_block(block, time_scale=time_scale)

    @classmethod
    def from_config(cls, cfg: ProviderConfig, **kwargs: Any) -> SimProvider:
        kwargs.pop("env", None)
        spec = cfg.spec if isinstance(cfg.spec, SimSpec) else SimSpec(time_scale=cfg.time_scale)
        return cls(
            cfg.name,
            spec,
            billed_rate_per_s=cfg.billed_rate_per_s,
            idle_billed_seconds=cfg.idle_billed_seconds,
            **kwargs,
        )

    @property
    def ledger(self) -> SimLedger:
        return self._ledger or get_default_ledger()

    @property
    def reports_queue_state(self) -> bool:  # type: ignore[override]
        return self.spec.reports_queue_state

    @property
    def time_scale(self) -> float:
        return self.spec.time_scale

    # --- draws ------------------------------------------------------------------------------

    def draw(self, key: str) -> dict[str, Any]:
        """The fate of the job with ``key``: same seed and key, same fate, in every process."""
        return self.spec.draw(key)

    # --- contract ---------------------------------------------------------------------------

    def submit(self, request: dict[str, Any]) -> JobHandle:
        """Draw the job's fate and return a handle carrying it (no I/O but the ledger counter)."""
        if not isinstance(request, dict):
            raise SubmitError(self.name, f"request must be a dict, got {type(request).__name__}")
        key = request.get("sim_key")
        if key is None:
            key = self.ledger.incr(seq_key(self.name)) - 1
        fate = self.draw(str(key))
        forced = (request.get("sim") or {}).get(self.name) or {}
        if not isinstance(forced, dict):
            raise SubmitError(self.name, "request['sim'][provider] must be a mapping")
        for field, value in forced.items():
            if field not in _OVERRIDES:
                raise SubmitError(self.name, f"unknown sim override {field!r}")
            if field.endswith("_s") and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
            ):
                raise SubmitError(self.name, f"sim override {field} must be seconds >= 0")
        fate.update(forced)
        if fate["outcome"] not in OUTCOMES:
            raise SubmitError(self.name, f"sim outcome must be one of {OUTCOMES}")
        if fate["outcome"] == "submit_error":
            metrics.provider_call(self.name, "submit", "rejected")
            raise SubmitError(self.name, "simulated submit failure")
        if fate["outcome"] == "rate_limited":
            metrics.provider_call(self.name, "submit", "rate_limited")
            raise SubmitError(self.name, "simulated HTTP 429: too many requests")
        fate["time_scale"] = self.spec.time_scale
        submit_s = float(fate.pop("submit_s", 0.0))
        if submit_s > 0:
            time.sleep(submit_s * self.spec.time_scale)  # a slow job API (simulated)
        job_id = f"sim-{self.name}-{uuid.uuid4().hex[:12]}"
        metrics.provider_call(self.name, "submit")
        return JobHandle(self.name, job_id, self.clock.now(), {"sim": fate})

    def status(self, handle: JobHandle) -> JobState:
        """The state at this instant, derived from the handle's draws and the ledger."""
        self.check_handle(handle)
        metrics.provider_call(self.name, "status")
        state = self._view(handle, self.clock.now()).state
        if state is JobState.QUEUED and not self.spec.reports_queue_state:
            return JobState.IN_PROGRESS
        return state

    def state_at(self, handle: JobHandle, at: float) -> JobState:
        """The job's state at epoch ``at`` as the ledger stands now (for audits: no metrics)."""
        self.check_handle(handle)
        return self._view(handle, at).state

    def result(self, handle: JobHandle, cap_s: float) -> AttemptResult:
        """Sleep until the job's terminal moment (or the cap), re-reading the ledger as it goes."""
        self.check_handle(handle)
        metrics.provider_call(self.name, "result")
        deadline = self.deadline(handle, cap_s)
        poll = self.spec.poll_s
        while True:
            now = self.clock.now()
            view = self._view(handle, now)
            if view.state.terminal:
                return self._terminal_result(handle, view)
            if now >= deadline:
                return self.timeout_result(handle, cap_s, self._events(handle, view, now))
            wake = min(self._next_change(handle, view), deadline)
            self.sleep(max(0.0, min(wake - now, poll)))

    def cancel(self, handle: JobHandle) -> CancelReceipt:
        """Record the cancel in the ledger, then watch the job reach its terminal state."""
        self.check_handle(handle)
        metrics.provider_call(self.name, "cancel")
        fate = _Fate.of(handle)
        scale = fate.time_scale
        receipt = CancelReceipt(provider=self.name, job_id=handle.job_id)
        now = self.clock.now()
        before = self._view(handle, now)
        receipt.cancel_sent_ms = now * 1000.0
        if before.state.terminal:
            receipt.was_running = False
            receipt.confirm_terminal(before.state, now * 1000.0)
            receipt.execution_ms_before_cancel = before.execution_s * 1000.0
            cost = self.cost_usd(before.execution_s)
            receipt.estimated_cost_usd = receipt.reconciled_cost_usd = cost
            receipt.billing_stop_confirmed = True
            receipt.note = f"already {before.state} before the cancel; nothing to stop"
            return receipt
        own = handle.extra["sim"]
        ack_s = float(own.get("cancel_ack_s", self.spec.cancel_ack_s))
        terminal_s = max(ack_s, float(own.get("cancel_terminal_s", self.spec.cancel_terminal_s)))
        record = {"sent": now, "terminal": now + terminal_s * scale}
        stored = self.ledger.set_if_absent(
            cancel_key(self.name, handle.job_id), json.dumps(record), LEDGER_TTL_S
        )
        if not stored:  # another process cancelled first: its record decides the timeline
            record = self._cancel_record(handle) or record
        ack_at = min(record["sent"] + ack_s * scale, record["terminal"])
        self.sleep(max(0.0, ack_at - now))
        receipt.cancel_ack_ms = max(ack_at, now) * 1000.0
        receipt.upgrade(Evidence.PROVIDER_ACK)
        # The record that won the ledger is the job's cancel from now on: no need to re-read it.
        view = self._view(handle, self.clock.now(), record)
        while not view.state.terminal:  # the sim always reaches terminal: confirm it
            self.sleep(max(0.0, self._next_change(handle, view) - self.clock.now()))
            view = self._view(handle, self.clock.now(), record)
        queued = not self._view(handle, record["sent"], record).started
        receipt.was_running = None if not self.spec.reports_queue_state else not queued
        receipt.scope = CancelScope.QUEUED_JOB if queued else CancelScope.REQUEST
        receipt.confirm_terminal(view.state, (view.terminal_at or self.clock.now()) * 1000.0)
        execution_s = view.execution_s
        receipt.execution_ms_before_cancel = execution_s * 1000.0
        receipt.estimated_cost_usd = receipt.reconciled_cost_usd = self.cost_usd(execution_s)
        receipt.billing_stop_confirmed = True
        if view.state is not JobState.CANCELLED:
            receipt.note = f"the job reached {view.state} before the cancel took effect"
        elif queued:
            receipt.note = "cancelled in queue; no worker started"
        return receipt

    # --- account hooks (login-check, costs): see providers/account_checks.py ----------------

    def login_check(self) -> LoginCheck:
        return account_checks.sim_login_check(self)

    def reported_spend(self, since: float) -> SpendReport:
        return account_checks.sim_spend(self, since)

    # --- timeline ---------------------------------------------------------------------------

    def timeline(self, handle: JobHandle) -> list[tuple[float, JobState]]:
        """The job's natural transitions (epoch s) if nobody cancels it: for schedulers."""
        fate = _Fate.of(handle)
        t0, scale = handle.submitted_at, fate.time_scale
        end_state = JobState.FAILED if fate.outcome == "failed" else JobState.COMPLETED
        return [
            (t0, JobState.QUEUED),
            (t0 + fate.queue_s * scale, JobState.IN_PROGRESS),
            (t0 + fate.end_s * scale, end_state),
        ]

    def next_change_at(self, handle: JobHandle) -> float | None:
        """Epoch seconds of the job's next state change, or None once it is terminal."""
        return self.status_and_next_change(handle)[1]

    def status_and_next_change(self, handle: JobHandle) -> tuple[JobState, float | None]:
        """:meth:`status` and :meth:`next_change_at` from one look at the ledger.

        A watch poll asks for both; one ledger read instead of two.
        """
        self.check_handle(handle)
        return self._reported(handle, self._view(handle, self.clock.now()))

    def status_and_next_change_many(
        self, handles: list[JobHandle]
    ) -> list[tuple[JobState, float | None]]:
        """:meth:`status_and_next_change` of several jobs from one ledger read (one ``MGET``
        on a Redis ledger): the batched watch loop polls a batch of sim jobs this way."""
        for handle in handles:
            self.check_handle(handle)
        ledger = self.ledger
        keys = [cancel_key(self.name, h.job_id) for h in handles]
        get_many = getattr(ledger, "get_many", None)
        raw = get_many(keys) if callable(get_many) else [ledger.get(k) for k in keys]
        now = self.clock.now()
        return [
            self._reported(handle, self._view(handle, now, json.loads(record) if record else None))
            for handle, record in zip(handles, raw, strict=True)
        ]

    def _reported(self, handle: JobHandle, view: _View) -> tuple[JobState, float | None]:
        """What one status poll reports of ``view``: its state, and when it next changes."""
        metrics.provider_call(self.name, "status")
        state = view.state
        if state is JobState.QUEUED and not self.spec.reports_queue_state:
            state = JobState.IN_PROGRESS
        return state, None if view.state.terminal else self._next_change(handle, view)

    def _cancel_record(self, handle: JobHandle) -> dict[str, float] | None:
        raw = self.ledger.get(cancel_key(self.name, handle.job_id))
        return json.loads(raw) if raw else None

    def _view(self, handle: JobHandle, now: float, cancel: Any = _UNREAD) -> _View:
        """The job at ``now``; ``cancel``: its cancel record when the caller already knows it
        (a record, once written, never changes), else it is read from the ledger."""
        fate = _Fate.of(handle)
        t0, scale = handle.submitted_at, fate.time_scale
        start, end = t0 + fate.queue_s * scale, t0 + fate.end_s * scale
        natural_end = JobState.FAILED if fate.outcome == "failed" else JobState.COMPLETED
        if cancel is _UNREAD:
            cancel = self._cancel_record(handle)
        if cancel is not None and cancel["sent"] < end:
            if cancel["sent"] < start:
                # a queued job leaves the queue at once: it never starts, costs nothing
                if now >= cancel["terminal"]:
                    return _View(JobState.CANCELLED, cancel["terminal"], cancel, False)
                return _View(JobState.QUEUED, None, cancel, False)
            if cancel["terminal"] < end:
                if now >= cancel["terminal"]:
                    ran = (cancel["terminal"] - start) / scale
                    return _View(JobState.CANCELLED, cancel["terminal"], cancel, True, ran)
                return _View(JobState.IN_PROGRESS, None, cancel, True, (now - start) / scale)
        if now >= end:
            return _View(natural_end, end, cancel, True, fate.run_s)
        if now >= start:
            return _View(JobState.IN_PROGRESS, None, cancel, True, (now - start) / scale)
        return _View(JobState.QUEUED, None, cancel, False)

    def _next_change(self, handle: JobHandle, view: _View) -> float:
        fate = _Fate.of(handle)
        t0, scale = handle.submitted_at, fate.time_scale
        times = [t0 + fate.end_s * scale]
        if not view.started and not view.cancel:
            times.append(t0 + fate.queue_s * scale)
        now = self.clock.now()
        if view.cancel:
            if view.cancel["terminal"] <= now:
                return now  # the cancel took effect since ``view`` was taken: look again
            times.append(view.cancel["terminal"])
        upcoming = [t for t in times if t > now]
        return min(upcoming) if upcoming else now

    def _events(self, handle: JobHandle, view: _View, now: float) -> list[LifecycleEvent]:
        fate = _Fate.of(handle)
        scale = fate.time_scale
        events = [LifecycleEvent(0.0, "queued" if self.spec.reports_queue_state else "submitted")]
        started_ms = fate.queue_s * scale * 1000.0
        if (
            view.started
            and self.spec.reports_queue_state
            and started_ms <= ((now - handle.submitted_at) * 1000.0)
        ):
            events.append(LifecycleEvent(started_ms, "running"))
        if view.cancel and view.cancel["sent"] <= now:
            sent_ms = (view.cancel["sent"] - handle.submitted_at) * 1000.0
            events.append(LifecycleEvent(sent_ms, "cancel_sent"))
        if view.state.terminal and view.terminal_at is not None:
            end_ms = (view.terminal_at - handle.submitted_at) * 1000.0
            events.append(LifecycleEvent(end_ms, view.state.value.lower()))
        return events

    def _terminal_result(self, handle: JobHandle, view: _View) -> AttemptResult:
        fate = _Fate.of(handle)
        assert view.terminal_at is not None
        wall_ms = round((view.terminal_at - handle.submitted_at) * 1000.0, 3)
        execution_s = view.execution_s
        metrics = {
            "delay_ms": round((fate.queue_s if view.started else 0.0) * 1000.0, 3),
            "execution_ms": round(execution_s * 1000.0, 3),
            "cost_usd": self.cost_usd(execution_s),
            "slow_mode": fate.slow,
            "time_scale": fate.time_scale,
        }
        payload, error = None, None
        if view.state is JobState.COMPLETED:
            silent = fate.outcome == "invalid"
            payload = _audio_b64(self.spec.audio_s, self.spec.sample_rate, silent)
        elif view.state is JobState.FAILED:
            error = "simulated job failure"
        self.ledger.set_if_absent(
            done_key(self.name, handle.job_id),
            json.dumps({"state": view.state.value, "at": view.terminal_at}),
            LEDGER_TTL_S,
        )
        return AttemptResult(
            provider=self.name,
            job_id=handle.job_id,
            state=view.state,
            wall_ms=wall_ms,
            payload=payload,
            metrics=metrics,
            events=self._events(handle, view, view.terminal_at),
            error=error,
        )
