"""``gpuhedge-celery rounds [--rounds N] [--wait S] --out FILE --go``: paired cold rounds.

In each round every provider gets the same request at the same moment, through its own adapter
(no race, nothing cancelled but a job that reaches its cap), and the round records, per
provider, the job's state, its time from submit to result as the adapter saw it (``wall_s``,
what a race's attempt latency is), whether
the config's validator accepted the result, the adapter's metrics (its queue delay as
``queue_delay_ms`` where the provider reports queue state) and the job's cost. Rounds are
``--wait`` seconds apart (default 300), so a scale-to-zero platform is cold again. The file is
the paired-round traces format ``gpuhedge-celery replay`` reads (``kind: round``), so any policy
can be replayed on the user's own platforms.

Times are provider seconds: with a compressed sim config (``time_scale`` below 1) wall times are
divided by it, and each line says its ``time_scale``. Every job can cost money: without
``--go`` the command prints the plan and its worst case and exits 2. Exit codes: 0 done, 1 the
budget refused a job (the rounds before it are written), 2 a dry run or bad input, 3 Redis
unreachable.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import datetime, timezone
from typing import Any

import click

from ..core.jobs import JobState
from ..core.settlement import ESTIMATED, UNPROVEN
from ..core.validators import validate
from ..errors import ConfigError, GpuHedgeError
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

STAGE = "gpuhedge-celery"


def _arm(
    cfg: Any,
    budget: JobBudget,
    provider: Any,
    request: dict[str, Any],
    job: str,
    secrets: list[str],
    live: LiveJobs,
) -> dict[str, Any]:
    """Run one provider's job of a round to its end (or its cap): its trace entry."""
    from ._accounts import one_line

    try:
        handle = provider.submit(request)
    except GpuHedgeError as e:
        budget.settle(job, 0.0, ESTIMATED)
        return {
            "state": "SUBMIT_FAILED",
            "wall_s": 0.0,
            "valid": False,
            "validation_reasons": [],
            "projected_cost_usd": 0.0,
            "metrics": {},
            "events": [],
            "error": one_line(e, secrets),
        }
    live.add(provider, handle)
    try:
        return _follow(cfg, budget, provider, handle, job, secrets)
    finally:
        live.done(handle)


def _follow(
    cfg: Any, budget: JobBudget, provider: Any, handle: Any, job: str, secrets: list[str]
) -> dict[str, Any]:
    """Wait for a submitted job's result (cancelling it at its cap), settle it, trace it."""
    from ._accounts import one_line

    scale, name = cfg.time_scale, provider.name
    worst = job_worst_usd(cfg, name)
    try:
        result = provider.result(handle, cfg.cap_s(name) * scale)
    except GpuHedgeError as e:  # the job's fate is unknown: stop it, keep its worst case
        receipt = provider.cancel(handle)
        budget.settle(job, worst, ESTIMATED if not receipt.leaked else UNPROVEN)
        return {
            "state": "FAILED",
            "wall_s": 0.0,
            "valid": False,
            "validation_reasons": [],
            "projected_cost_usd": None,
            "metrics": {},
            "events": [],
            "error": one_line(e, secrets),
        }
    wall_s = result.wall_ms / 1000.0 / scale  # the job's submit -> its result, as a race sees it
    cost = result.metrics.get("cost_usd")
    if result.state is JobState.TIMEOUT:  # at its cap: stop it, as a race would
        receipt = provider.cancel(handle)
        cost = None if receipt.leaked else receipt.estimated_cost_usd
    elif cost is None and result.metrics.get("execution_ms") is not None:
        cost = provider.cost_usd(float(result.metrics["execution_ms"]) / 1000.0)
    budget.settle(job, settled_usd(provider, cost, worst), ESTIMATED)
    valid, reasons = False, []
    if result.state is JobState.COMPLETED:
        verdict = validate(cfg.validator.name, result.payload, **dict(cfg.validator.options))
        valid, reasons = verdict.ok, list(verdict.reasons)
    metrics = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float, str, bool))}
    if provider.reports_queue_state and result.metrics.get("delay_ms") is not None:
        metrics["queue_delay_ms"] = float(result.metrics["delay_ms"])
    return {
        "state": result.state.value,
        "wall_s": round(wall_s, 3),
        "valid": valid,
        "validation_reasons": reasons,
        "projected_cost_usd": None if cost is None else round(cost, 6),
        "metrics": metrics,
        "events": [
            {"t_ms": round(e.t_ms / scale, 3), "stage": e.stage, "detail": e.detail}
            for e in result.events
        ],
        "error": None if result.error is None else one_line(result.error, secrets),
    }


def run_round(
    cfg: Any,
    budget: JobBudget,
    providers: list[Any],
    request: dict[str, Any],
    round_id: int,
    secrets: list[str],
    live: LiveJobs,
) -> dict[str, Any]:
    """One paired round: every provider's job submitted at once (one thread each)."""
    for p in providers:  # reserve every job before any is submitted: all or none run
        budget.reserve(f"{round_id}-{p.name}", p.name)
    arms: dict[str, dict[str, Any]] = {}
    failures: list[BaseException] = []

    def one(p: Any) -> None:
        try:
            arms[p.name] = _arm(cfg, budget, p, request, f"{round_id}-{p.name}", secrets, live)
        except BaseException as e:  # re-raised below, in the command's thread
            failures.append(e)

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in providers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    valid = {n: a["wall_s"] for n, a in arms.items() if a["valid"]}
    winner = min(valid, key=valid.__getitem__) if valid else None
    return {
        "kind": "round",
        "stage": STAGE,
        "round_id": round_id,
        "block": 1,
        "ts": datetime.now(timezone.utc).isoformat(),
        "time_scale": cfg.time_scale,
        "winner": winner,
        "winner_wall_s": valid.get(winner) if winner else None,
        "providers": {p.name: arms[p.name] for p in providers},
    }


def _last_round(path: str) -> int:
    from ..core.replay import load_rounds

    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return 0
    return max(r.round_id for r in load_rounds(path))


@click.command(name="rounds")
@shown(
    "--rounds", "count", type=click.IntRange(1, 10_000), default=10, help="How many paired rounds."
)
@shown(
    "--wait",
    "wait_s",
    type=click.FloatRange(0),
    default=300.0,
    help="Real seconds between rounds (long enough for workers to scale to zero).",
)
@providers_option
@request_option("The request every provider gets")
@click.option("--out", "out_path", required=True, help="The traces file (JSONL) to write.")
@click.option(
    "--append", is_flag=True, help="Add rounds to an existing --out file (round ids continue)."
)
@go_option
def command(
    count: int,
    wait_s: float,
    names: str | None,
    request_text: str,
    out_path: str,
    append: bool,
    go: bool,
) -> None:
    """Run paired cold rounds (every provider, the same request) and write replayable traces;
    a dry run unless --go."""
    from ..cli import root_config
    from ._accounts import secrets_of

    request = _request(request_text)
    cfg = root_config()
    chosen = provider_names(cfg, names, "--providers")
    if len(chosen) < 2:
        raise ConfigError("a paired round needs at least two providers", key="--providers")
    if os.path.exists(out_path) and not append:
        raise ConfigError(
            "exists: add --append to add rounds to it, or name a new file",
            key="--out",
            file=out_path,
        )
    first = _last_round(out_path) + 1 if append else 1
    worst = sum(job_worst_usd(cfg, n) for n in chosen) * count
    gate(
        go,
        [
            f"would run {count} paired round(s) of {len(chosen)} provider(s), "
            f"{wait_s:g} s apart, into {out_path}",
            *plan_lines(cfg, chosen, count),
        ],
        worst,
    )
    secrets = secrets_of(cfg)
    providers = [build(cfg, n) for n in chosen]
    budget = JobBudget(cfg, "rounds")
    try:
        out = open(out_path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115
    except OSError as e:
        raise ConfigError(f"cannot write {out_path}: {e.strerror}", key="--out") from None
    live = LiveJobs()

    def run() -> None:
        for i in range(count):
            if i:
                time.sleep(wait_s)
            record = run_round(cfg, budget, providers, request, first + i, secrets, live)
            out.write(json.dumps(record) + "\n")
            out.flush()
            walls = ", ".join(
                f"{n} {a['wall_s']:.1f}s{'' if a['valid'] else ' (invalid)'}"
                for n, a in record["providers"].items()
            )
            click.echo(f"round {record['round_id']}: {walls}")

    with out:
        on_interrupt(live, run)
    rates = " ".join(
        f"--rate {n}={p.billed_rate_per_s:g}:{p.idle_billed_seconds:g}"
        for n, p in ((n, cfg.provider(n)) for n in chosen)
    )
    click.echo(
        f"wrote {count} round(s) to {out_path}; replay them with "
        f"`gpuhedge-celery replay {out_path} {rates}`"
    )
