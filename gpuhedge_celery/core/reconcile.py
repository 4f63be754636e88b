"""The reconcile rules: compare what Redis says about each GPU with what its worker reports.

Pure code (no Redis, no Celery, time passed in), so every drift case is a row in a table test.
The beat task (:mod:`gpuhedge_celery.tasks.reconcile`) gathers the two views, calls :func:`plan`
and applies the actions with token-checked store calls, which is what makes a pass idempotent:
an action whose premise changed since the views were read (the token moved on, a lease appeared)
does nothing.

Rules, per GPU:

1. Lease held, the GPU's worker answered and runs nothing, the lease is older than ``grace_s``
   → free it (the holder crashed before or after running; the grace covers a job in flight
   between the waiter that claimed the lease and the GPU worker that will run it).
2. No lease, the GPU's worker reports a running job → restore the lease with that job's holder
   and token (Redis lost it: failover, restart without persistence, a flush).
3. Lease held by one token while the worker runs another → no write; reported as a conflict. The
   running job's renewal fails and stops it; the fencing check refuses it anyway.
4. Host stopped heartbeating → its GPUs are out of the pool already (the store lists live hosts
   only); once the host has been silent for a whole lease TTL, a lease still held there is freed:
   its holder could not have renewed it from a dead host.
5. The worker did not answer (timeout, busy, partitioned) → no change: absence of a reply is not
   evidence of idleness.
6. The worker's health reading found a fault (ECC, Xid) or memory held by a foreign process, and
   Redis does not show the GPU out of the pool for it → take it out (``out``, with the reason
   ``fault`` or ``health``). The worker does this itself; the pass is the backstop for a write
   that was lost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LeaseView:
    """The lease Redis holds for a GPU."""

    holder: str
    token: int
    since: float | None = None  # epoch seconds the lease was claimed, when the store knows
    ttl_left_ms: int | None = None


@dataclass(frozen=True)
class GpuView:
    """One registered GPU as Redis sees it: its host's liveness and its lease, if any."""

    gpu_id: str
    pool: str
    host: str
    host_live: bool = True
    host_silent_s: float | None = None  # seconds since the host's last heartbeat, if known
    ttl_ms: int = 30_000  # the pool's lease TTL
    lease: LeaseView | None = None
    out: frozenset[str] = frozenset()  # why the GPU is out of the pool (reasons), if it is


@dataclass(frozen=True)
class RunningJob:
    """A job a GPU worker reports running right now."""

    task_id: str
    token: int
    holder: str = ""
    since: float | None = None

    @property
    def lease_holder(self) -> str:
        return self.holder or self.task_id


@dataclass(frozen=True)
class GpuReport:
    """A GPU worker's answer for one GPU: the jobs it is running (empty when idle)."""

    gpu_id: str
    running: tuple[RunningJob, ...] = ()
    # the worker's latest reading
    health: dict[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Action:
    """One correction: ``free`` or ``restore`` a lease, take a GPU ``out`` of the pool
    (``detail["reason"]``), or a ``conflict`` only reported."""

    kind: str
    gpu_id: str
    token: int
    holder: str = ""
    reason: str = ""
    detail: dict[str, Any] = field(default_factory=dict, compare=False)


def plan(
    gpus: Sequence[GpuView],
    reports: Mapping[str, GpuReport],
    *,
    now: float,
    grace_s: float = 10.0,
) -> list[Action]:
    """The corrections that bring Redis in line with the workers' reports (see module rules)."""
    actions: list[Action] = []
    for gpu in sorted(gpus, key=lambda g: g.gpu_id):
        lease = gpu.lease
        if not gpu.host_live:
            silent = gpu.host_silent_s
            if lease is not None and silent is not None and silent * 1000 >= gpu.ttl_ms:
                actions.append(
                    Action(
                        "free", gpu.gpu_id, lease.token, lease.holder, "host stopped heartbeating"
                    )
                )
            continue
        report = reports.get(gpu.gpu_id)
        if report is None:
            continue  # rule 5: unknown is not idle
        health = report.health or {}
        for reason in ("fault", "health"):  # rule 6
            if health.get(reason) and reason not in gpu.out:
                detail = {"reason": reason, "detail": health[reason]}
                actions.append(Action("out", gpu.gpu_id, 0, "", health[reason], detail))
        running = max(report.running, key=lambda job: job.token, default=None)
        if lease is None:
            if running is not None:
                actions.append(
                    Action(
                        "restore",
                        gpu.gpu_id,
                        running.token,
                        running.lease_holder,
                        "GPU busy without a lease",
                        {"since": running.since},
                    )
                )
            continue
        if running is None:
            age = None if lease.since is None else now - lease.since
            if age is not None and age >= grace_s:
                actions.append(
                    Action("free", gpu.gpu_id, lease.token, lease.holder, "lease held on idle GPU")
                )
            continue
        if running.token != lease.token:
            actions.append(
                Action(
                    "conflict",
                    gpu.gpu_id,
                    lease.token,
                    lease.holder,
                    f"worker runs token {running.token}, lease has token {lease.token}",
                )
            )
    return actions
