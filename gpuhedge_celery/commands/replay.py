"""``gpuhedge-celery replay``: evaluate hedging policies on recorded paired-round traces."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import click

from ..core.policies import Policy, parse_policy
from ..core.rates import PUBLISHED_RATES, ProviderRate
from ..core.replay import (
    CALIBRATION_LAST_ROUND,
    SUBSETS,
    Round,
    default_policies,
    load_rounds,
    provider_table,
    queue_signal_providers,
    replay_policy,
    select,
    sweep,
)
from ..errors import ConfigError
from ._plots import box_path, write_box

FAMILY_TITLES = {
    "single": "singles",
    "race": "immediate races (hedge at 0 s)",
    "fixed": "fixed hedges",
    "cutover": "queue-state cutovers",
    "cascade": "cascades",
    "adaptive": "adaptive policies (learning as they go)",
    "custom": "other policies",
}


class BadInput(click.ClickException):
    """A one-line usage error (exit code 2)."""

    exit_code = 2


def parse_rates(specs: Sequence[str]) -> dict[str, ProviderRate]:
    """Published rates overridden by ``PROVIDER=USD_PER_S[:IDLE_S]`` options."""
    rates = dict(PUBLISHED_RATES)
    for spec in specs:
        name, sep, value = spec.partition("=")
        rate, _, idle = value.partition(":")
        try:
            if not sep or not name:
                raise ValueError
            rates[name] = ProviderRate(float(rate), float(idle) if idle else 0.0)
        except (ValueError, ConfigError):
            raise BadInput(f"bad --rate {spec!r}: expected PROVIDER=USD_PER_S[:IDLE_S]") from None
    return rates


def _family(policy: Policy) -> str:
    if policy.kind == "hedge":
        return "race" if policy.params()["hedge_after_ms"] == 0 else "fixed"
    return policy.kind if policy.kind in FAMILY_TITLES else "custom"


def _s(value: float | None) -> str:
    return "inf" if value is None or math.isinf(value) else f"{value:.1f}"


def format_text(
    rounds: Sequence[Round],
    rows: list[dict[str, Any]],
    families: dict[str, str],
    subsets: Sequence[str],
    deadlines: Sequence[float],
) -> str:
    """The human-readable report: per-provider table, then each subset's policy families."""
    lines = [f"Per provider over {len(rounds)} rounds (finite values; nearest-rank):"]
    lines.append(f"  {'provider':<12} {'valid':>7} {'p50 s':>7} {'p95 s':>7} {'max s':>7}  queue")
    for p in provider_table(rounds):
        queue = p["queue_delay_s"]
        queue_text = f"{queue[0]:.1f}-{queue[1]:.1f} s" if queue else "no signal"
        lines.append(
            f"  {p['provider']:<12} {p['valid']:>3}/{p['rounds']:<3} {_s(p['p50_s']):>7} "
            f"{_s(p['p95_s']):>7} {_s(p['max_s']):>7}  {queue_text}"
        )
    miss_heads = " ".join(f"{'miss>' + format(d, 'g') + 's (Wilson 95%)':>24}" for d in deadlines)
    head = (
        f"  {'policy':<44} {'n':>3} {'p50 s':>6} {'p95 s':>6} {'p95 lin':>7} {'max s':>6} "
        f"{miss_heads} {'active $':>8} {'billed $':>8} {'hedged':>7}"
    )
    for subset in subsets:
        subset_rows = [r for r in rows if r["subset"] == subset]
        if not subset_rows:
            continue
        lines += ["", f"== {subset} (n = {subset_rows[0]['n']}) =="]
        for family, title in FAMILY_TITLES.items():
            chosen = [r for r in subset_rows if families[r["policy"]] == family]
            if not chosen:
                continue
            lines += [f"-- {title}", head]
            for r in chosen:
                misses = " ".join(
                    f"{r['misses'][format(d, 'g')]:>3}/{r['n']:<3} "
                    f"({r['miss_ci'][format(d, 'g')][0] * 100:.0f}-"
                    f"{r['miss_ci'][format(d, 'g')][1] * 100:.0f}%)".rjust(24)
                    for d in deadlines
                )
                lines.append(
                    f"  {r['policy']:<44} {r['n']:>3} {_s(r['p50_s']):>6} {_s(r['p95_s']):>6} "
                    f"{_s(r['p95_linear_s']):>7} {_s(r['max_s']):>6} {misses} "
                    f"{r['active_usd']:>8.4f} {r['billed_usd']:>8.4f} "
                    f"{r['hedged']:>3}/{r['n']:<3}"
                )
    return "\n".join(lines)


def write_plot(
    path: str,
    rounds: Sequence[Round],
    policies: Sequence[Policy],
    rates: dict[str, ProviderRate],
    subset: str,
    deadlines: Sequence[float],
    calibration: int = CALIBRATION_LAST_ROUND,
) -> None:
    """A PNG of latency CDFs per policy on a log time axis, SLO deadlines marked, and a box
    plot per policy beside it (``<path stem>_box.png``)."""
    try:
        import matplotlib
    except ImportError:
        raise BadInput("--plot needs matplotlib: pip install 'gpuhedge-celery[plot]'") from None
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    wanted = {r.round_id for r in select(rounds, subset, calibration)}
    styles = {"single": ":", "race": "-.", "fixed": "--", "cutover": "-", "cascade": "-"}
    colours = plt.get_cmap("tab20").colors  # type: ignore[attr-defined]  # tab20 is a ListedColormap
    fig, ax = plt.subplots(figsize=(10, 6))
    by_policy: dict[str, list[float]] = {}
    for i, policy in enumerate(policies):
        results = replay_policy(policy, rounds, rates, calibration)
        latencies = sorted(r.latency_s for r in results if r.round_id in wanted)
        by_policy[policy.name] = latencies
        n = len(latencies)
        finite = [v for v in latencies if not math.isinf(v)]
        ys = [(k + 1) / n for k in range(len(finite))]
        ax.step(
            finite,
            ys,
            where="post",
            label=policy.name,
            linestyle=styles.get(_family(policy), "-"),
            color=colours[i % len(colours)],
            linewidth=1.6,
        )
    for d in deadlines:
        ax.axvline(d, color="black", linestyle="--", linewidth=1)
        ax.annotate(f"SLO {d:g} s", (d, 1.0), xytext=(3, -12), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("end-to-end latency (s, log scale)")
    ax.set_ylabel("fraction of requests answered")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Replayed latency CDF ({subset}, n = {len(wanted)})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise BadInput(f"cannot write plot {path!r}: {e.strerror}") from None
    finally:
        plt.close(fig)
    title = f"Replayed latency by policy ({subset}, n = {len(wanted)})"
    write_box(box_path(path), by_policy, deadlines, title)


def _plot_selection(rounds: Sequence[Round], policies: Sequence[Policy]) -> list[Policy]:
    """Without --policy, plot a readable subset: singles, and from each queue-signal primary
    its immediate races, 10 s hedges, cutovers and cascades."""
    lead = set(queue_signal_providers(rounds)) or {policies[0].providers()[0]}
    keep = []
    for p in policies:
        family = _family(p)
        from_lead = p.providers()[0] in lead
        if family == "single" or (from_lead and family != "fixed"):
            keep.append(p)
        elif from_lead and p.params().get("hedge_after_ms") == 10_000:
            keep.append(p)
    return keep


@click.command("replay")
@click.argument("traces", type=click.Path(dir_okay=False))
@click.option(
    "--subset",
    type=click.Choice(SUBSETS),
    default=None,
    help="Rounds to evaluate (default: all, calibration and evaluation).",
)
@click.option(
    "--calibration-rounds",
    "calibration",
    type=click.IntRange(min=0),
    default=CALIBRATION_LAST_ROUND,
    show_default=True,
    help="Rounds with round_id <= N calibrate: an adaptive policy learns them whole, then "
    "runs the later rounds in order knowing only what its own races observed.",
)
@click.option(
    "--policy",
    "policy_names",
    multiple=True,
    help="Policy name, repeatable: single:P, hedge:P->H@Ds, cutover:P->H@qQs+sSs, "
    "cascade:P->H->F@qQs+sSs+eEs, adaptive:P->H[,H...][@dNs+bR] (default: the full sweep).",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of rows.")
@click.option(
    "--plot",
    "plot_path",
    default=None,
    help="Write a latency CDF PNG here, and a box plot per policy beside it (NAME_box.png).",
)
@click.option(
    "--deadline",
    "deadlines",
    type=float,
    multiple=True,
    help="SLO deadline in seconds for miss counts, repeatable (default 60).",
)
@click.option(
    "--rate",
    "rate_specs",
    multiple=True,
    help="Override a provider's rate: PROVIDER=USD_PER_S[:IDLE_S] (default: published rates).",
)
def command(
    traces: str,
    subset: str | None,
    calibration: int,
    policy_names: tuple[str, ...],
    as_json: bool,
    plot_path: str | None,
    deadlines: tuple[float, ...],
    rate_specs: tuple[str, ...],
) -> None:
    """Replay policies on paired-round TRACES with the live race engine on a virtual clock."""
    deadline_list = list(deadlines) or [60.0]
    if any(d <= 0 or math.isinf(d) or math.isnan(d) for d in deadline_list):
        raise BadInput("--deadline must be a positive number of seconds")
    rates = parse_rates(rate_specs)
    try:
        rounds = load_rounds(traces)
        if policy_names:
            policies = [parse_policy(name) for name in policy_names]
        else:
            policies = [p for _, p in default_policies(rounds)]
        families = {p.name: _family(p) for p in policies}
        subsets = [subset] if subset else list(SUBSETS)
        rows = sweep(rounds, policies, subsets, deadline_list, rates, calibration)
    except ConfigError as e:
        raise BadInput(str(e)) from None
    if plot_path:
        plotted = policies if policy_names else _plot_selection(rounds, policies)
        write_plot(plot_path, rounds, plotted, rates, subset or "all", deadline_list, calibration)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    else:
        click.echo(format_text(rounds, rows, families, subsets, deadline_list))
    if plot_path:
        click.echo(f"wrote {plot_path} and {box_path(plot_path)}", err=True)
