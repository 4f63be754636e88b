"""``gpuhedge-celery plan [TRACES] [--map NAME=TRACE] [--json]``: what the config would cost.

Tables of the config's providers (role, rate, idle billing, cap, worst case per attempt) and of
its budget (every cap), and the configured policy's worst case per request (every attempt it
can launch at its worst case, never clamped to a cap), with a warning for each attempt a cap
refuses (``warnings`` in --json). Given paired-round TRACES (``replay``'s format), the
configured policy is replayed on them with the config's rates: its expected (mean) billed cost
per request and the p95 of that cost, beside its latency. Each provider the policy races must
be in the traces under its own name or mapped with ``--map CONFIG_NAME=TRACE_NAME``. Nothing
is sent anywhere. Exit codes: 0, 2 bad input.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import click

from ..core.budget import worst_case_usd
from ..core.rates import ProviderRate
from ..core.stats import nearest_rank
from ..errors import ConfigError


def provider_rows(cfg: Any) -> list[dict[str, Any]]:
    from ..config_budget import spends_money

    rows = []
    for name, p in cfg.providers.items():
        cap = cfg.cap_s(name)
        rows.append(
            {
                "provider": name,
                "role": p.role,
                "adapter": p.adapter,
                "deployed": p.deployed,
                "rate_usd_per_s": p.billed_rate_per_s,
                "idle_s": p.idle_billed_seconds,
                "idle_usd": p.idle_billed_seconds * p.billed_rate_per_s,
                "cap_s": cap,
                "worst_case_usd": worst_case_usd(cap, p.billed_rate_per_s, p.idle_billed_seconds),
                "spends_money": spends_money(p),
            }
        )
    return rows


def budget_rows(caps: Any) -> list[dict[str, Any]]:
    rows = [
        {"cap": "max_usd_per_request", "usd": caps.max_usd_per_request},
        {"cap": "max_usd_per_day", "usd": caps.max_usd_per_day},
        {"cap": "ceiling_usd", "usd": caps.ceiling_usd},
    ]
    for kind, scoped in (("providers", caps.providers), ("keys", caps.keys)):
        for name, cap in scoped.items():
            for what in ("max_usd_per_day", "max_usd_total"):
                if getattr(cap, what) is not None:
                    rows.append({"cap": f"{kind}.{name}.{what}", "usd": getattr(cap, what)})
    return rows


def replay_costs(cfg: Any, traces: str, subset: str, mapping: dict[str, str]) -> dict[str, Any]:
    """The configured policy replayed on ``traces``: cost per request (mean, p95), latency."""
    from ..core.replay import load_rounds, providers_of, replay_policy, select

    rounds = select(load_rounds(traces), subset)
    if not rounds:
        raise ConfigError(f"no rounds in subset {subset!r}", key="TRACES")
    real_time = dataclasses.replace(cfg, time_scale=1.0)  # traces are in provider seconds
    policy = real_time.make_policy()
    params = policy.params()
    known = providers_of(rounds)
    rates: dict[str, ProviderRate] = {}
    for role in ("primary", "hedge", "fallback"):
        name = params.get(role)
        if not isinstance(name, str):
            continue
        trace = mapping.get(name, name)
        if trace not in known:
            raise ConfigError(
                f"provider {name!r} is not in the traces (they have: {', '.join(known)}); "
                f"map it: --map {name}=TRACE_NAME",
                key="--map",
            )
        p = cfg.provider(name)
        rates[trace] = ProviderRate(p.billed_rate_per_s, p.idle_billed_seconds)
        params[role] = trace
    replayed = type(policy)(**params)
    results = replay_policy(replayed, rounds, rates)
    billed = [r.billed_usd for r in results]
    latencies = [r.latency_s for r in results]
    return {
        "policy": policy.name,
        "replayed_as": replayed.name,
        "rounds": len(results),
        "subset": subset,
        "cost_per_request_usd": {
            "mean": sum(billed) / len(billed),
            "p95": nearest_rank(billed, 0.95),
            "max": max(billed),
        },
        "latency_s": {"p50": nearest_rank(latencies, 0.5), "p95": nearest_rank(latencies, 0.95)},
        "hedged": sum(1 for r in results if r.hedged),
    }


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:,.4f}"


def render(plan: dict[str, Any]) -> str:
    lines = ["providers:"]
    lines.append(
        f"  {'name':<16} {'role':<9} {'adapter':<8} {'$/s':>10} {'idle s':>7} "
        f"{'idle $':>8} {'cap s':>6} {'worst $':>8}"
    )
    for r in plan["providers"]:
        name = r["provider"] + ("" if r["deployed"] else " (off)")
        lines.append(
            f"  {name:<16} {r['role']:<9} {r['adapter']:<8} {r['rate_usd_per_s']:>10.6f} "
            f"{r['idle_s']:>7g} {r['idle_usd']:>8.4f} {r['cap_s']:>6g} {r['worst_case_usd']:>8.4f}"
        )
    lines += ["", "budget:"]
    for r in plan["budget"]:
        lines.append(f"  {r['cap']:<40} {_usd(r['usd'])}")
    if not plan["budget_enabled"]:
        lines.append("  (no cap: budgets are off)")
    lines += [
        "",
        f"policy: {plan['policy']}",
        f"  worst case per request: {_usd(plan['worst_case_per_request_usd'])} "
        "(every attempt it can launch, each at its worst case)",
    ]
    if plan["warnings"]:
        lines += [
            "",
            f"warnings ({len(plan['warnings'])}): the budget refuses attempts this policy launches",
        ]
        lines += [f"  {w}" for w in plan["warnings"]]
    found = plan.get("replay")
    if found:
        cost, lat = found["cost_per_request_usd"], found["latency_s"]
        lines += [
            "",
            f"replayed on {found['rounds']} rounds ({found['subset']}) as {found['replayed_as']}:",
            f"  expected cost per request {_usd(cost['mean'])}, p95 {_usd(cost['p95'])}, "
            f"max {_usd(cost['max'])}",
            f"  latency p50 {lat['p50']:.1f} s, p95 {lat['p95']:.1f} s; "
            f"hedged {found['hedged']} of {found['rounds']}",
        ]
    return "\n".join(lines)


@click.command(name="plan")
@click.argument("traces", required=False)
@click.option(
    "--subset",
    default="all",
    show_default=True,
    type=click.Choice(["all", "calibration", "evaluation"]),
)
@click.option(
    "--map",
    "mapping",
    multiple=True,
    metavar="NAME=TRACE",
    help="Replay config provider NAME as the traces' TRACE provider.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def command(traces: str | None, subset: str, mapping: tuple[str, ...], as_json: bool) -> None:
    """Providers, budget and the policy's worst case; with TRACES, its expected cost."""
    from ..cli import root_config
    from ..config import cap_warnings, planned_attempts

    cfg = root_config()
    pairs = {}
    for item in mapping:
        name, sep, trace = item.partition("=")
        if not sep or not name or not trace:
            raise ConfigError(f"expected NAME=TRACE, got {item!r}", key="--map")
        pairs[name] = trace
    policy = cfg.make_policy()
    attempts = planned_attempts(cfg, policy)
    # Not clamped to max_usd_per_request: a cap below this refuses attempts (see warnings).
    per_request = sum(a.worst_case_usd for a in attempts)
    plan: dict[str, Any] = {
        "providers": provider_rows(cfg),
        "budget": budget_rows(cfg.budget),
        "budget_enabled": cfg.budget.enabled,
        "policy": policy.name,
        "worst_case_per_request_usd": per_request,
        "warnings": [w.text() for w in cap_warnings(cfg, policy)],
    }
    if traces:
        plan["replay"] = replay_costs(cfg, traces, subset, pairs)
    click.echo(json.dumps(plan, indent=2) if as_json else render(plan))
