"""``gpuhedge-celery policy``: what an adaptive policy has learned, and forgetting it."""

from __future__ import annotations

import json
import math
from typing import Any

import click

from ..core.adaptive import AdaptivePolicy
from ..core.policies import parse_policy
from ..errors import ConfigError


class BadInput(click.ClickException):
    exit_code = 2


def _store() -> Any:
    from ..cli import cli_redis_client
    from ..store.adaptive import AdaptiveStore

    settings = click.get_current_context().find_root().obj.settings
    return AdaptiveStore(cli_redis_client(), settings.prefix)


def _redis_url() -> str:
    return str(click.get_current_context().find_root().obj.settings.redis_url)


def _adaptive(name: str) -> AdaptivePolicy:
    try:
        policy = parse_policy(name)
    except ConfigError as e:
        raise BadInput(str(e)) from None
    if not isinstance(policy, AdaptivePolicy):
        raise BadInput(f"{name!r} is a {policy.kind} policy: only adaptive policies learn")
    return policy


@click.group(name="policy")
def command() -> None:
    """Adaptive policies' learned state (shared by every coordinator through Redis)."""


def _seconds(value: Any) -> str:
    return "never" if value is None else f"{float(value):g} s"


def _text(name: str, shown: dict[str, Any]) -> str:
    lines = [f"policy {name}"]
    learned = shown.get("learned")
    if not learned:
        lines.append("  nothing learned yet: no coordinator has planned a race of it")
        lines.append(f"  requests planned: {shown['requests']}")
        return "\n".join(lines)
    plan = learned["plan"]
    if plan.get("hedge") is None:
        lines.append("  plan: the primary alone (no hedge pays off)")
    else:
        lines.append(f"  hedge: {plan['hedge']}, backup: {plan.get('backup') or 'none'}")
        queued = "cancel it" if plan.get("cancel_queued", True) else "keep it beside the hedge"
        lines.append(f"  cutover poll: {_seconds(plan.get('cutover_s'))} (still queued: {queued})")
        lines.append(f"  safety hedge: {_seconds(plan.get('safety_s'))}")
        lines.append(f"  backup joins: {_seconds(plan.get('backup_s'))} after the hedge")
    est = learned.get("estimate")
    if est:
        p95 = "inf" if math.isinf(est["p95_s"]) else f"{est['p95_s']:.1f}"
        lines.append(
            f"  expected: p95 {p95} s, active ${est['active_usd']:.4f} per request, "
            f"{est['miss_share'] * 100:.1f} % over the deadline, {est['hedge_share'] * 100:.0f} %"
            " hedged"
        )
    samples = ", ".join(f"{p} {n}" for p, n in sorted(learned.get("samples", {}).items()))
    lines.append(
        f"  learned from {learned['races']} races ({learned['paired']} paired rounds); "
        f"jobs kept: {samples or 'none'}"
    )
    if learned.get("alarms"):
        lines.append("  in alarm: " + ", ".join(sorted(learned["alarms"])))
    tokens = shown.get("tokens")
    lines.append(f"  requests planned: {shown['requests']}; observations kept: {shown['seen']}")
    if tokens is not None:
        lines.append(f"  hedge budget: {tokens:.2f} tokens")
    return "\n".join(lines)


@command.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print it as JSON.")
def show(name: str, as_json: bool) -> None:
    """What the adaptive policy NAME learned: its current plan (hedge, cutover, safety and
    backup times), what it expects of it, its hedge budget and how many races taught it."""
    from ..store.connection import translate_errors

    policy = _adaptive(name)
    store = _store()
    with translate_errors(_redis_url()):
        counts = store.counts(policy.name)
        seen = store.seen_count(policy.name)
    shown = {
        "policy": policy.name,
        "requests": int(counts.get("seq", 0)),
        "tokens": counts.get("tokens"),
        "seen": seen,
        "learned": counts.get("plan"),
    }
    if as_json:
        click.echo(json.dumps(shown, indent=2))
    else:
        click.echo(_text(policy.name, shown))


@command.command("reset")
@click.argument("name")
@click.option("--yes", is_flag=True, help="Do not ask.")
def reset(name: str, yes: bool) -> None:
    """Forget what the adaptive policy NAME learned: every coordinator starts it again from
    nothing (and its hedge budget full)."""
    policy = _adaptive(name)
    from ..store.connection import translate_errors

    if not yes:
        click.confirm(f"forget what {policy.name} learned?", abort=True)
    with translate_errors(_redis_url()):
        _store().reset(policy.name)
    click.echo(f"reset {policy.name}")
