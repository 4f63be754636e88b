"""What the measurement commands that drive provider adapters directly share.

``cancel-audit`` and ``rounds`` submit jobs through each provider's own adapter, in this
process, with no race around them: the config's providers are built here (a RunPod adapter
takes its rate limiter from ``--redis-url``), and every job is budgeted like a race's attempt.
When the config sets any budget cap, each job reserves its worst case in the budget ledger on
``--redis-url`` before its submit (a refusal stops the command) and settles at what it cost
once it ended, so ``gpuhedge-celery budget`` and ``ledger export`` show the measurement's spend
beside the races'. A job this process could not settle is settled at its full reservation by
the janitor's budget sweep.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core.budget import cap_name, cap_slots, to_nano, utc_day, worst_case_usd
from ..errors import BudgetExceeded, ConfigError

if TYPE_CHECKING:
    from ..config import GpuHedgeConfig
    from ..providers.base import Provider


def provider_names(cfg: GpuHedgeConfig, text: str | None, option: str) -> list[str]:
    """``A,B`` as deployed provider names of ``cfg`` (default: every deployed provider)."""
    names = (
        [n.strip() for n in text.split(",")]
        if text
        else [p.name for p in cfg.providers.values() if p.deployed]
    )
    if not names or any(not n for n in names):
        raise ConfigError(f"expected comma-separated provider names, got {text!r}", key=option)
    for name in names:
        found = cfg.providers.get(name)
        if found is None:
            known = ", ".join(cfg.providers) or "none"
            raise ConfigError(f"no provider {name!r} (known: {known})", key=option)
        if not found.deployed:
            raise ConfigError(f"provider {name!r} has deployed: false", key=option)
    if len(set(names)) != len(names):
        raise ConfigError(f"a provider appears twice in {names}", key=option)
    return names


def build(cfg: GpuHedgeConfig, name: str) -> Provider:
    """Provider ``name`` as this command drives it (shared state on ``--redis-url``)."""
    kwargs: dict[str, Any] = {}
    adapter = cfg.provider(name).adapter
    if adapter in ("runpod", "pool"):
        from ..cli import cli_redis_client, root_settings

        client, prefix = cli_redis_client(), root_settings().prefix
        if adapter == "runpod":  # the endpoint's rate limits are shared with the workers
            from ..providers.ratelimit import RedisLimiter

            kwargs["limiter"] = RedisLimiter(client, prefix)
        else:
            from ..store.leases import LeaseStore

            kwargs["store"] = LeaseStore(client, prefix)
    return cfg.build(name, **kwargs)


def job_worst_usd(cfg: GpuHedgeConfig, name: str) -> float:
    """The most one job of ``name`` can cost: billed to its cap, plus one idle window."""
    p = cfg.provider(name)
    return worst_case_usd(cfg.cap_s(name), p.billed_rate_per_s, p.idle_billed_seconds)


def plan_lines(cfg: GpuHedgeConfig, names: Sequence[str], jobs_each: int) -> list[str]:
    """One line per provider: its jobs and their worst case."""
    lines = []
    for name in names:
        usd = job_worst_usd(cfg, name)
        lines.append(
            f"  {name}: {jobs_each} job(s), worst case ${usd:,.4f} each (cap {cfg.cap_s(name):g} s)"
        )
    return lines


def settled_usd(provider: Provider, cost_usd: float | None, worst_usd: float) -> float:
    """What a job is settled at: its cost plus one idle window, never above its worst case
    (unknown cost: the worst case)."""
    if cost_usd is None:
        return worst_usd
    idle = provider.idle_billed_seconds * provider.billed_rate_per_s
    return min(worst_usd, max(0.0, cost_usd) + idle)


class JobBudget:
    """Reservations for the jobs of one command run (a no-op when the config sets no cap)."""

    def __init__(self, cfg: GpuHedgeConfig, run: str):
        self.cfg = cfg
        self.run_id = f"{run}-{uuid.uuid4().hex[:12]}"
        self.store: Any = None
        if cfg.budget.enabled:
            from ..cli import cli_redis_client, root_settings
            from ..store.budget import BudgetStore
            from ..store.replicas import ReplicaAcks

            core = root_settings()
            # a reservation counts only once the replicas hold it, as in the workers
            acks = ReplicaAcks(core.wait_replicas, core.wait_timeout_ms)
            self.store = BudgetStore(cli_redis_client(), core.prefix, acks=acks)

    def reserve(self, job: str, provider: str) -> None:
        """Reserve one job's worst case; :class:`BudgetExceeded` when a cap refuses it."""
        if self.store is None:
            return
        from ..store.connection import translate_errors

        caps, now = self.cfg.budget, time.time()
        p = self.cfg.provider(provider)
        pending = self.store.prepare(
            self.run_id,
            job,
            amount_usd=job_worst_usd(self.cfg, provider),
            day=utc_day(now),
            provider=provider,
            key=None,
            role="primary",
            caps_nano=cap_slots(caps, provider, None),
            cap_name=lambda slot: cap_name(caps, provider, None, slot),
            open_until_ms=int(
                (now + (self.cfg.cap_s(provider) + p.idle_billed_seconds) * self.cfg.time_scale)
                * 1000
            ),
        )
        with translate_errors():
            found = self.store.reserve(pending)
        if not found.granted:
            raise BudgetExceeded(
                f"{provider} job {job} not submitted: {found.reason}", reason="budget"
            )

    def settle(self, job: str, usd: float, source: str) -> None:
        """Settle one job at ``usd`` (``source``: estimated, reconciled or unproven)."""
        if self.store is None:
            return
        from ..store.connection import translate_errors

        with translate_errors():
            self.store.settle(self.run_id, [(job, to_nano(usd), source)], int(time.time() * 1000))


class LiveJobs:
    """The jobs a command submitted and has not yet seen end, so an interrupt (Ctrl-C, SIGTERM)
    cancels them through their provider's native cancel instead of leaving paid jobs running.

    The jobs still run in their own threads when the command is interrupted; :meth:`cancel_all`
    cancels each from the interrupted thread and says, per job, whether the cancel was confirmed
    (a leaked one is named, with the provider and job id, for the user to stop by hand).
    """

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._jobs: dict[int, tuple[Provider, Any]] = {}

    def add(self, provider: Provider, handle: Any) -> None:
        with self._lock:
            self._jobs[id(handle)] = (provider, handle)

    def done(self, handle: Any) -> None:
        with self._lock:
            self._jobs.pop(id(handle), None)

    def cancel_all(self) -> list[str]:
        """Cancel every job still live; one line per job saying how its cancel ended."""
        with self._lock:
            jobs, self._jobs = list(self._jobs.values()), {}
        lines = []
        for provider, handle in jobs:
            receipt: object
            try:
                receipt = provider.cancel(handle)
                leaked = receipt.leaked
            except Exception as e:  # noqa: BLE001 - report it and go on with the others
                leaked, receipt = True, f"{type(e).__name__}"
            what = "LEAKED: stop it by hand" if leaked else "cancelled (confirmed)"
            lines.append(f"{provider.name} job {handle.job_id}: {what}")
        return lines


def on_interrupt(live: LiveJobs, run: Any) -> Any:
    """``run()``; on Ctrl-C or SIGTERM, cancel ``live``'s jobs, print how each ended, exit 130."""
    import signal

    import click

    def terminated(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    import threading

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminated) if main else None
    try:
        return run()
    except KeyboardInterrupt:
        click.echo("interrupted: cancelling the jobs still running", err=True)
        for line in live.cancel_all():
            click.echo(f"  {line}", err=True)
        raise click.exceptions.Exit(130) from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
