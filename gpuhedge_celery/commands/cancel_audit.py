"""``gpuhedge-celery cancel-audit --providers A,B [--repeats N] --go``: forced cancels, audited.

Each provider's adapter gets ``--repeats`` jobs cancelled **early** (``--early-s`` after the
submit, usually still queued) and as many cancelled **late** (once the job runs: its status
says IN_PROGRESS, then ``--late-s`` more). Every cancel goes through the adapter's own
``cancel``, which confirms by polling to a terminal state, exactly as a race cancels its
losers; no race, no workers. The audit prints, per provider and phase, the matrix of attempts,
cancels confirmed terminal, leaks and jobs that were running at the cancel: the evidence behind
each adapter's cancel claim (``docs/cancellation-semantics.md``). ``--out FILE`` writes one
``forced_cancel`` line per cancel and a closing ``cancel_audit_summary`` (GPUHedge's format).

Every job can cost money: without ``--go`` the command prints the plan and its worst case and
exits 2. Seconds are provider time (a compressed sim config scales them by ``time_scale``).
Exit codes: 0 every cancel confirmed, 1 a cancel leaked or the budget refused a job, 2 a dry
run or bad input, 3 Redis unreachable.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from ..core.cancel_audit import PHASES, forced_cancel_record, format_matrix, summary_record, tally
from ..core.jobs import JobState
from ..core.settlement import ESTIMATED, RECONCILED, UNPROVEN
from ..errors import ConfigError, GpuHedgeError, SubmitError
from ._direct import (
    JobBudget,
    LiveJobs,
    build,
    job_worst_usd,
    on_interrupt,
    plan_lines,
    provider_names,
    settled_usd,
)
from ._options import providers_option, request_option, shown
from ._spend import gate, go_option
from .race import _request

POLL_S = 0.1  # provider seconds between status polls while waiting for a job to run
MIN_POLL_S = 0.005  # real seconds: the floor when a compressed sim scales the poll down


def _wait_running(provider: Any, handle: Any, limit_s: float, scale: float) -> JobState:
    """Poll until the job runs (or ends, or ``limit_s`` real seconds pass); its last state."""
    deadline = time.monotonic() + limit_s
    state = provider.status(handle)
    while state is JobState.QUEUED or state is JobState.UNKNOWN:
        if time.monotonic() >= deadline:
            break
        time.sleep(max(MIN_POLL_S, POLL_S * scale))
        state = provider.status(handle)
    return state


def _one(
    cfg: Any,
    budget: JobBudget,
    provider: Any,
    phase: str,
    attempt: int,
    request: dict[str, Any],
    early_s: float,
    late_s: float,
    live: LiveJobs,
) -> dict[str, Any]:
    """Submit, wait for the phase's moment, cancel, settle: the ``forced_cancel`` record."""
    job = f"{phase}-{attempt}-{provider.name}"
    budget.reserve(job, provider.name)
    try:
        handle = provider.submit(request)
    except SubmitError:
        budget.settle(job, 0.0, ESTIMATED)  # refused: no job exists
        raise
    live.add(provider, handle)
    try:
        return _cancel_at(cfg, budget, provider, handle, job, phase, attempt, early_s, late_s)
    finally:
        live.done(handle)


def _cancel_at(
    cfg: Any,
    budget: JobBudget,
    provider: Any,
    handle: Any,
    job: str,
    phase: str,
    attempt: int,
    early_s: float,
    late_s: float,
) -> dict[str, Any]:
    """Wait for the phase's moment, cancel, settle: the ``forced_cancel`` record."""
    scale, name = cfg.time_scale, provider.name
    try:
        if phase == "early":
            time.sleep(early_s * scale)
            state = provider.status(handle)
        else:
            state = _wait_running(provider, handle, cfg.cap_s(name) * scale, scale)
            if not state.terminal:
                time.sleep(late_s * scale)
                state = provider.status(handle)
    except GpuHedgeError:  # a status poll failed: the job exists, so cancel it all the same
        state = JobState.UNKNOWN
    cancel_at_s = (provider.clock.now() - handle.submitted_at) / scale
    receipt = provider.cancel(handle)
    worst = job_worst_usd(cfg, name)
    if receipt.leaked:
        budget.settle(job, worst, UNPROVEN)
    else:
        cost = receipt.reconciled_cost_usd
        source = RECONCILED if cost is not None else ESTIMATED
        cost = cost if cost is not None else receipt.estimated_cost_usd
        budget.settle(job, settled_usd(provider, cost, worst), source)
    return forced_cancel_record(
        name,
        phase,
        attempt,
        cancel_at_s=cancel_at_s,
        state_before=str(state),
        receipt=receipt.to_dict(),
        ts=time.time(),
    )


@click.command(name="cancel-audit")
@providers_option
@shown("--repeats", type=click.IntRange(1, 1000), default=3, help="Cancels per provider and phase.")
@request_option("The job's request")
@shown(
    "--early-s",
    type=click.FloatRange(0),
    default=0.5,
    help="Early cancels: seconds after the submit.",
)
@shown(
    "--late-s",
    type=click.FloatRange(0),
    default=0.5,
    help="Late cancels: seconds after the job was first seen running.",
)
@click.option("--out", "out_path", default=None, help="Write the JSONL audit here.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary record as JSON.")
@go_option
def command(
    names: str | None,
    repeats: int,
    request_text: str,
    early_s: float,
    late_s: float,
    out_path: str | None,
    as_json: bool,
    go: bool,
) -> None:
    """Cancel jobs on purpose, early and late, through each provider's adapter; a dry run
    unless --go."""
    from ..cli import root_config
    from ._accounts import one_line, secrets_of

    request = _request(request_text)
    cfg = root_config()
    chosen = provider_names(cfg, names, "--providers")
    jobs = len(PHASES) * repeats
    worst = sum(job_worst_usd(cfg, n) for n in chosen) * jobs
    gate(
        go,
        [
            f"would cancel {jobs} job(s) on each of {len(chosen)} provider(s) "
            f"({repeats} early, {repeats} late)",
            *plan_lines(cfg, chosen, jobs),
        ],
        worst,
    )
    out = None
    if out_path:
        try:
            out = open(out_path, "w", encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as e:
            raise ConfigError(f"cannot write {out_path}: {e.strerror}", key="--out") from None
    secrets = secrets_of(cfg)
    budget = JobBudget(cfg, "cancel-audit")
    records: list[dict[str, Any]] = []
    live = LiveJobs()

    def run() -> None:
        for name in chosen:
            provider = build(cfg, name)
            for phase in PHASES:
                for attempt in range(1, repeats + 1):
                    try:
                        record = _one(
                            cfg, budget, provider, phase, attempt, request, early_s, late_s, live
                        )
                    except SubmitError as e:
                        click.echo(
                            f"{name} {phase} #{attempt}: submit refused: {one_line(e, secrets)}",
                            err=True,
                        )
                        continue
                    records.append(record)
                    if out is not None:
                        out.write(json.dumps(record) + "\n")
                        out.flush()

    try:
        on_interrupt(live, run)
        matrix = tally(records)
        spent = sum(r["receipt"].get("estimated_cost_usd") or 0.0 for r in records)
        summary = summary_record(matrix, spent, time.time())
        if out is not None:
            out.write(json.dumps(summary) + "\n")
    finally:
        if out is not None:
            out.close()
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        click.echo("\n".join(format_matrix(matrix, chosen)))
        click.echo(
            f"cancelled jobs' estimated cost: ${spent:,.6f}"
            + (f"; wrote {out_path}" if out_path else "")
        )
    leaked = sum(c["leaked"] for phases in matrix.values() for c in phases.values())
    if leaked or len(records) < jobs * len(chosen):
        raise click.exceptions.Exit(1)
