"""The ``pool`` adapter: a self-hosted GPU pool from the lease table, raced like any provider.

A pool attempt is one ``gpuhedge.pooled_infer`` task, sent by name with a fresh task id that
becomes the job id. Submitting only sends the message: the waiting for a free GPU happens on a
coordination worker (event-driven, FIFO-fair), never in the thread that submits.

Lifecycle, read from Redis without ever calling ``result.get()``:

* ``QUEUED`` while the request waits for a lease (in the pool's FIFO queue, or its message not
  yet picked up);
* ``IN_PROGRESS`` while a GPU holds it (a lease whose holder is the task id, or the GPU
  worker's running record);
* ``COMPLETED`` / ``FAILED`` / ``CANCELLED`` from the task's stored meta in the Celery result
  backend (a failure caused by our own cancel reads ``CANCELLED``).

Between the GPU worker clearing its records and the result being stored (a few ms) a finished
job reads ``QUEUED`` once more; a cutover that cancels it then finds it ``COMPLETED``, and the
race treats such a job as one that may still win.

Cancel (``tasks.cancel.cancel_pooled``): a queued request leaves the wait queue at once (scope
``queued_job``, $0, confirmed); a running one is stopped by its GPU worker, which releases the
lease and stores a "cancelled while running" failure. The receipt is confirmed only once the
GPU no longer runs it, no lease names it and its stored result is terminal, all observed
within ``cancel_confirm_s``; otherwise it is a leaked receipt stating what was seen.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ..core.jobs import AttemptResult, JobHandle, JobState, LifecycleEvent
from ..core.receipts import CancelReceipt, CancelScope, Evidence
from ..errors import GpuHedgeError, ProviderError, SubmitError
from ..names import pool_name_problem
from . import account_checks
from .account import LoginCheck, SpendReport
from .base import Provider
from .options import Block

if TYPE_CHECKING:
    from ..store.leases import LeaseStore
    from .provider_config import ProviderConfig

# Failures the pool itself reports when a request was cancelled (see tasks/cancel.py).
_CANCEL_ERRORS = ("AcquireTimeout", "RunnerStopped")
_BEFORE_RUN = ("before it waited", "before it started", "wait of")


@dataclass(frozen=True)
class PoolSpec:
    """The parsed ``pool:`` block: which pool, which GPUs, how often to look."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    poll_s: float = 0.5
    cancel_confirm_s: float = 10.0

    @classmethod
    def from_block(cls, block: Block) -> PoolSpec:
        """Validate ``providers.<name>.pool`` (one-line errors; unknown keys reported)."""
        name = block.string("name")
        problem = pool_name_problem(name)
        if problem is not None:
            raise block.error("name", problem)
        labels = block.string_map("labels")
        poll_s = block.number("poll_s", 0.5, positive=True)
        confirm = block.number("cancel_confirm_s", 10.0, positive=True)
        block.finish()
        return cls(name, labels, poll_s, confirm)


@dataclass
class _Seen:
    """One look at a pooled request: stored meta state, and where it holds a GPU."""

    state: JobState | None  # terminal state from the result backend, None while pending
    meta: dict[str, Any]
    gpu_id: str | None  # GPU it holds a lease on or runs on, if any
    since_ms: int | None  # when it started running (running record), if running
    running: bool

    @property
    def job_state(self) -> JobState:
        """What a status poll reports: the stored end, else running on a GPU, else queued."""
        if self.state is not None:
            return self.state
        return JobState.IN_PROGRESS if self.gpu_id else JobState.QUEUED


class PoolProvider(Provider):
    """A GPU pool of the lease table as a race provider (see the module docstring)."""

    adapter = "pool"
    reports_queue_state = True

    def __init__(
        self,
        name: str,
        spec: PoolSpec,
        *,
        app: Any = None,
        store: LeaseStore | None = None,
        **kwargs: Any,
    ):
        super().__init__(name, **kwargs)
        self.spec = spec
        self._app = app
        self._store = store

    def __repr__(self) -> str:
        return f"PoolProvider(name={self.name!r}, pool={self.spec.name!r})"

    @classmethod
    def parse_options(cls, block: Block, *, time_scale: float | None = None) -> PoolSpec:
        # GPU jobs run in real time whatever the config's time_scale: nothing here is scaled.
        return PoolSpec.from_block(block)

    @classmethod
    def from_config(cls, cfg: ProviderConfig, **kwargs: Any) -> PoolProvider:
        from ..errors import ConfigError

        if not isinstance(cfg.spec, PoolSpec):
            raise ConfigError(
                "the pool adapter needs a block pool: {name: ...}",
                file=cfg.source,
                key=f"providers.{cfg.name}.pool",
            )
        for other in ("env", "ledger"):  # other adapters' build arguments
            kwargs.pop(other, None)
        return cls(
            cfg.name,
            cfg.spec,
            billed_rate_per_s=cfg.billed_rate_per_s,
            idle_billed_seconds=cfg.idle_billed_seconds,
            **kwargs,
        )

    # --- where the pool lives (built lazily: importing the adapter builds no Celery app) ----

    @property
    def app(self) -> Any:
        if self._app is None:
            from ..tasks.app import app

            self._app = app
        return self._app

    @property
    def store(self) -> LeaseStore:
        if self._store is None:
            from ..tasks.gpu import lease_store

            self._store = lease_store()
        return self._store

    # --- the contract -----------------------------------------------------------------------

    def submit(self, request: dict[str, Any]) -> JobHandle:
        """Send ``pooled_infer`` by name with a fresh task id (the job id); returns at once."""
        from ..tasks.app import QUEUE_POOL, TASK_POOLED_INFER

        job_id = f"pool-{uuid.uuid4().hex}"
        submitted_at = self.clock.now()
        kwargs: dict[str, Any] = {"pool": self.spec.name}
        if self.spec.labels:
            kwargs["labels"] = dict(self.spec.labels)
        try:
            self.app.send_task(
                TASK_POOLED_INFER, (request,), kwargs, task_id=job_id, queue=QUEUE_POOL
            )
        except Exception as e:  # a broker error: no message was queued, or we cannot tell
            detail = " ".join(str(e).split())[:300]  # one line, whatever the driver says
            raise SubmitError(
                self.name, f"could not send {TASK_POOLED_INFER} ({type(e).__name__}: {detail})"
            ) from e
        return JobHandle(self.name, job_id, submitted_at, extra={"pool": self.spec.name})

    def status(self, handle: JobHandle) -> JobState:
        """QUEUED / IN_PROGRESS from the lease table, terminal states from the result backend."""
        self.check_handle(handle)
        return self._look(handle).job_state

    def status_and_next_change_many(
        self, handles: list[JobHandle]
    ) -> list[tuple[JobState, float | None]]:
        """:meth:`status` of several requests in three round trips whatever their number (the
        pool's GPUs, their running records and leases, the stored metas), each with when to look
        again: the batched watch loop polls a batch of pool jobs this way."""
        for handle in handles:
            self.check_handle(handle)
        places = self._where_many([h.job_id for h in handles])
        backend = self.app.backend
        try:
            raw = backend.mget([backend.get_key_for_task(h.job_id) for h in handles])
            metas = [backend.decode_result(v) if v else {"status": "PENDING"} for v in raw]
        except Exception as e:
            raise ProviderError(self.name, f"cannot read the result backend: {e}") from e
        again = self.clock.now() + self.spec.poll_s
        out: list[tuple[JobState, float | None]] = []
        for handle, meta in zip(handles, metas, strict=True):
            state = _Seen(_meta_state(meta), meta, *places[handle.job_id]).job_state
            out.append((state, None if state.terminal else again))
        return out

    # --- account hooks (login-check, costs): see providers/account_checks.py ----------------

    def login_check(self) -> LoginCheck:
        return account_checks.pool_login_check(self)

    def reported_spend(self, since: float) -> SpendReport:
        return account_checks.pool_spend(self, since)

    def next_change_at(self, handle: JobHandle) -> float:
        """When the race should poll this job again (``poll_s`` from now)."""
        return self.clock.now() + self.spec.poll_s

    def result(self, handle: JobHandle, cap_s: float) -> AttemptResult:
        """The stored result once terminal; right-censored ``TIMEOUT`` at the cap."""
        self.check_handle(handle)
        deadline = self.deadline(handle, cap_s)
        while True:
            try:
                seen = self._look(handle)
            except ProviderError as e:
                return AttemptResult(
                    self.name, handle.job_id, JobState.FAILED, self.elapsed_ms(handle), error=str(e)
                )
            if seen.state is not None:
                return self._attempt_result(handle, seen)
            now = self.clock.now()
            if now >= deadline:
                events = [LifecycleEvent(self.elapsed_ms(handle), "running")] if seen.gpu_id else []
                return self.timeout_result(handle, cap_s, events)
            self.sleep(min(self.spec.poll_s, deadline - now))

    def cancel(self, handle: JobHandle) -> CancelReceipt:
        """Leave the wait queue or stop the running job; confirm by observing it end."""
        from ..tasks.cancel import cancel_pooled

        self.check_handle(handle)
        receipt = CancelReceipt(provider=self.name, job_id=handle.job_id)
        receipt.cancel_sent_ms = self.now_ms()
        try:
            before = self._look(handle)
            if before.state is not None:  # it ended before we asked: nothing to stop
                receipt.was_running = False
                receipt.note = f"already ended {before.state.value} before the cancel"
                receipt.confirm_terminal(before.state, self.now_ms())
                return receipt
            info = cancel_pooled(self.store, self.spec.name, handle.job_id)
        except (GpuHedgeError, ProviderError) as e:
            receipt.note = f"cancel failed: {e}"
            return receipt  # no_evidence, leaked
        receipt.cancel_ack_ms = self.now_ms()
        receipt.upgrade(Evidence.PROVIDER_ACK)  # the stop flag is set / the queue entry is gone
        if info["left_queue"]:
            return self._confirm_queued(handle, receipt)
        return self._confirm_stopped(handle, receipt, before)

    # --- internals --------------------------------------------------------------------------

    def _confirm_queued(self, handle: JobHandle, receipt: CancelReceipt) -> CancelReceipt:
        """The request left the FIFO queue: it can never get a GPU now. Wait briefly for its
        stored failure (its waiter wakes on the queue's wake message) to confirm with it."""
        receipt.was_running = False
        receipt.scope = CancelScope.QUEUED_JOB
        receipt.execution_ms_before_cancel = 0.0
        receipt.estimated_cost_usd = 0.0
        receipt.reconciled_cost_usd = 0.0
        receipt.billing_stop_confirmed = True
        until = self.clock.now() + min(2.0, self.spec.cancel_confirm_s)
        state = None
        while self.clock.now() < until:
            try:
                state = self._look(handle).state
            except ProviderError:
                state = None
            if state is not None:
                break
            self.sleep(0.02)
        receipt.confirm_terminal(state or JobState.CANCELLED, self.now_ms())
        receipt.note = "left the pool's wait queue before any GPU was leased" + (
            "" if state is not None else " (its waiter had not stored the failure yet)"
        )
        return receipt

    def _confirm_stopped(
        self, handle: JobHandle, receipt: CancelReceipt, before: _Seen
    ) -> CancelReceipt:
        """Poll until the GPU worker stopped it: no running record, no lease, a stored end."""
        since_ms = before.since_ms
        ran = before.running
        on_gpu = before.gpu_id
        stopped_ms: float | None = None
        seen = before
        until = self.clock.now() + self.spec.cancel_confirm_s
        while True:
            try:
                seen = self._look(handle)
            except ProviderError as e:
                receipt.note = f"could not confirm: {e}"
                seen = _Seen(None, {}, on_gpu, since_ms, ran)
            else:
                if seen.running:
                    ran, since_ms = True, seen.since_ms or since_ms
                if seen.gpu_id:
                    on_gpu = seen.gpu_id
                elif stopped_ms is None:
                    stopped_ms = self.now_ms()
                if seen.state is not None and seen.gpu_id is None:
                    break
            if self.clock.now() >= until:
                break
            self.sleep(0.02)  # quick, so this receipt usually reaches the race before a watch
        receipt.was_running = ran
        if ran and since_ms is not None:
            end = stopped_ms if stopped_ms is not None else self.now_ms()
            receipt.execution_ms_before_cancel = max(0.0, end - since_ms)
            receipt.estimated_cost_usd = self.cost_usd(receipt.execution_ms_before_cancel / 1000)
        if seen.state is None or seen.gpu_id is not None:
            where = f"still on GPU {seen.gpu_id}" if seen.gpu_id else "GPU freed, no stored end"
            receipt.note = receipt.note or (
                f"not confirmed within {self.spec.cancel_confirm_s:g} s: {where}"
            )
            return receipt  # leaked, with the ack as the only evidence
        error = _error_text(seen.meta)
        if not ran and seen.state is JobState.CANCELLED and any(m in error for m in _BEFORE_RUN):
            receipt.scope = CancelScope.QUEUED_JOB
            receipt.execution_ms_before_cancel = 0.0
            receipt.estimated_cost_usd = 0.0
        else:
            receipt.scope = CancelScope.REQUEST
        if receipt.execution_ms_before_cancel is not None:
            receipt.reconciled_cost_usd = receipt.estimated_cost_usd
            receipt.billing_stop_confirmed = True  # the GPU's lease is gone: no job runs there
        receipt.confirm_terminal(seen.state, stopped_ms or self.now_ms())
        receipt.note = f"GPU {on_gpu} released it" if on_gpu else (error or "ended")[:200]
        return receipt

    def _look(self, handle: JobHandle) -> _Seen:
        """Read where the request is: its GPU (lease or running record), then its stored meta.

        The GPU is read first, so a job that finishes between the two reads shows its stored
        end rather than a spurious wait.
        """
        gpu_id, since_ms, running = self._where_many([handle.job_id])[handle.job_id]
        try:
            meta = self.app.backend.get_task_meta(handle.job_id)
        except Exception as e:
            raise ProviderError(self.name, f"cannot read the result backend: {e}") from e
        return _Seen(_meta_state(meta), meta, gpu_id, since_ms, running)

    def _where_many(self, task_ids: list[str]) -> dict[str, tuple[str | None, int | None, bool]]:
        """(GPU, running since epoch ms, running?) of each of ``task_ids`` in this pool, from
        one read of the pool's GPUs and one ``MGET`` of their running records and leases."""
        store = self.store
        k = store.keys
        found: dict[str, tuple[str | None, int | None, bool]] = dict.fromkeys(
            task_ids, (None, None, False)
        )
        try:
            with store.guard():
                pool = self.spec.name
                gpus = sorted(str(g) for g in store.client.smembers(k.pool_gpus(pool)))
                if not gpus:
                    return found
                values = store.client.mget(  # all on the pool's hash tag: one slot
                    [k.running(pool, g) for g in gpus] + [k.lease(pool, g) for g in gpus]
                )
        except GpuHedgeError as e:
            raise ProviderError(self.name, f"cannot read the lease table: {e}") from e
        running, leases = values[: len(gpus)], values[len(gpus) :]
        for gpu_id, value in zip(gpus, leases, strict=True):  # waiting for its first step
            task = _text(value).split("|", 2)[-1] if value is not None else None
            if task in found:
                found[task] = (gpu_id, None, False)
        for gpu_id, value in zip(gpus, running, strict=True):  # a running record comes first
            task, _, rest = _text(value).partition("|")
            if value is not None and task in found:
                since = rest.partition("|")[2]
                found[task] = (gpu_id, int(since) if since.isdigit() else None, True)
        return found

    def _attempt_result(self, handle: JobHandle, seen: _Seen) -> AttemptResult:
        """The AttemptResult of a terminal request, from its stored meta."""
        done_at = _epoch(seen.meta.get("date_done"))
        wall_ms = self.elapsed_ms(handle)
        if done_at is not None:
            wall_ms = max(0.0, (done_at - handle.submitted_at) * 1000.0)
        events: list[LifecycleEvent] = []
        metrics: dict[str, Any] = {"pool": self.spec.name}
        payload = None
        error = None
        out = seen.meta.get("result")
        if seen.state is JobState.COMPLETED and isinstance(out, dict):
            payload = out.get("output")
            run_s = float(out.get("run_s") or 0.0)
            started = out.get("started_at")
            metrics.update(
                gpu_id=out.get("gpu_id"),
                token=out.get("token"),
                attempt=out.get("attempt"),
                execution_ms=run_s * 1000.0,
                cost_usd=self.cost_usd(run_s),
            )
            if isinstance(started, (int, float)):
                delay_ms = max(0.0, (started - handle.submitted_at) * 1000.0)
                metrics["delay_ms"] = delay_ms
                events.append(LifecycleEvent(delay_ms, "running", str(out.get("gpu_id"))))
        else:
            error = _error_text(seen.meta) or f"ended {seen.state}"
        events.append(LifecycleEvent(wall_ms, str(seen.state).lower()))
        return AttemptResult(
            self.name,
            handle.job_id,
            seen.state or JobState.UNKNOWN,
            wall_ms,
            payload=payload,
            metrics=metrics,
            events=events,
            error=error,
        )


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def _error_text(meta: dict[str, Any]) -> str:
    """``Type: message`` of a stored failure (an exception, or the raw JSON form)."""
    exc = meta.get("result")
    if isinstance(exc, BaseException):
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, dict) and "exc_type" in exc:
        message = exc.get("exc_message")
        if isinstance(message, (list, tuple)):
            message = " ".join(str(m) for m in message)
        return f"{exc['exc_type']}: {message}"
    return ""


def _meta_state(meta: dict[str, Any]) -> JobState | None:
    """The terminal state a stored task meta shows, or None while the request is pending."""
    status = meta.get("status")
    if status == "SUCCESS":
        return JobState.COMPLETED
    if status == "REVOKED":
        return JobState.CANCELLED
    if status == "FAILURE":
        error = _error_text(meta)
        kind = error.partition(":")[0]
        if kind in _CANCEL_ERRORS and "cancelled" in error:
            return JobState.CANCELLED
        return JobState.FAILED
    return None


def _epoch(value: Any) -> float | None:
    """Epoch seconds of a stored ``date_done`` (a datetime or its ISO text), if readable."""
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            return None
    else:
        return None
    if moment.tzinfo is None:  # Celery stores UTC
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


__all__ = ["PoolProvider", "PoolSpec"]
