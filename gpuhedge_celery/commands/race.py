"""``gpuhedge-celery race REQUEST --go``: send one hedged race to the workers and wait for it.

REQUEST is a JSON object (``-`` reads standard input, ``@FILE`` a file). The race runs on the
coordination workers of ``--redis-url`` with the config's providers, so it can spend money:
without ``--go`` the command prints the policy, each provider's worst case and the request's
worst-case spend (capped by ``budget.max_usd_per_request``) and exits 2, sending nothing.
Exit codes: 0 a winner, 1 the race failed (``RaceFailed``; ``BudgetExceeded`` when the budget
refused it), 2 a dry run or bad input, 3 Redis unreachable.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import click

from ..errors import ConfigError, RaceFailed
from ._spend import gate, go_option


def _request(text: str) -> dict[str, Any]:
    raw = sys.stdin.read() if text == "-" else text
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as f:
                raw = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read {text[1:]}: {e.strerror or e}", key="REQUEST") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"not JSON: {e.msg} at line {e.lineno}", key="REQUEST") from None
    if not isinstance(data, dict):
        raise ConfigError(f"expected a JSON object, got {type(data).__name__}", key="REQUEST")
    return data


def worst_case(spec: Any, caps: Any, cfg: Any = None) -> tuple[list[str], float]:
    """Lines describing a race's providers and worst cases, and the request's worst case; a
    ``warning:`` line for each attempt a budget cap would refuse (config check's wording)."""
    from ..core.budget import PlannedAttempt, cap_conflicts

    roles = {v: k for k, v in spec.policy.params().items() if k in ("primary", "hedge", "fallback")}
    lines, total, planned = [f"policy: {spec.policy.name}"], 0.0, []
    for name in spec.policy.providers():
        rate = spec.rates[name]
        role = roles.get(name) or (cfg.provider(name).role if cfg is not None else "primary")
        a = PlannedAttempt(name, role, spec.caps_s[name], rate["rate_per_s"], rate["idle_s"])
        planned.append(a)
        total += a.worst_case_usd
        lines.append(f"  {name}: worst case ${a.worst_case_usd:,.4f} (cap {a.cap_s:g} s)")
    if caps.max_usd_per_request is not None and total > caps.max_usd_per_request:
        total = caps.max_usd_per_request  # what the reservations can reach at most
    if caps.enabled:
        lines += [f"  warning: {c.text()}" for c in cap_conflicts(caps, planned)]
    return lines, total


def celery_app() -> Any:
    """A Celery app on the ``--redis-url`` / ``--prefix`` of this invocation (sends tasks)."""
    from ..cli import root_settings
    from ..tasks.app import create_app
    from ..tasks.config import GlueConfig

    settings = root_settings()
    env = {
        **os.environ,
        "GPUHEDGE_REDIS_URL": settings.redis_url,
        "GPUHEDGE_PREFIX": settings.prefix,
    }
    return create_app(GlueConfig.from_env(env))


def start_race(app: Any, body: dict[str, Any], **kwargs: Any) -> Any:
    """Send one ``hedged_infer`` (kwargs: policy, providers, budget_key, arm); its AsyncResult,
    whose id is the race id."""
    from ..names import QUEUE_COORD, TASK_HEDGED_INFER
    from ..tasks.sending import broker_errors

    sent = {k: v for k, v in kwargs.items() if v is not None}
    with broker_errors(app):
        return app.send_task(TASK_HEDGED_INFER, (body,), sent, queue=QUEUE_COORD)


def check_redis() -> None:
    """One quick PING of ``--redis-url``: Redis down is the usual one-line error (exit 3) at
    once, as every other command gives it, not after a send's own attempt to reach it."""
    from ..cli import cli_redis_client, root_settings
    from ..store.connection import translate_errors

    with translate_errors(root_settings().redis_url):
        cli_redis_client().ping()


def send_race(
    body: dict[str, Any], *, timeout_s: float, app: Any = None, **kwargs: Any
) -> dict[str, Any]:
    """Race ``body`` on the workers and wait for its result (the winner's, without payload).

    Raises :class:`RaceFailed` (its ``race_id`` set) when the race has no winner.
    """
    res = start_race(app or celery_app(), body, **kwargs)
    try:
        out = res.get(timeout=timeout_s)
    except RaceFailed as e:
        e.race_id = res.id
        raise
    return {k: v for k, v in out.items() if k != "payload"}


def race_options(f: Any) -> Any:
    """The options ``race`` and ``infer`` share: what to race, how long to wait, --go; the
    command passes them on to :func:`gated_race` as they come."""
    for option in reversed(
        [
            click.argument("request"),
            click.option(
                "--policy", default=None, help="A policy name or spec [default: the config's]."
            ),
            click.option(
                "--providers", default=None, help="Comma-separated provider names, primary first."
            ),
            click.option(
                "--budget-key", default=None, help="Whose budget the race spends (budget.keys)."
            ),
            click.option(
                "--timeout",
                "timeout_s",
                type=click.FloatRange(1),
                default=300.0,
                show_default=True,
                help="Seconds to wait for the result.",
            ),
            go_option,
        ]
    ):
        f = option(f)
    return f


def gated_race(
    request: str,
    policy: str | None,
    providers: str | None,
    budget_key: str | None,
    timeout_s: float,
    go: bool,
) -> Callable[[], dict[str, Any]]:
    """The race :func:`race_options` asked for, once the --go gate let it through (a dry run
    prints its worst case and exits 2): call it to send the race and wait for its result, as
    :func:`send_race` does."""
    from .. import settings as process_settings
    from ..cli import root_config
    from ..race.spec import build_spec, check_request

    body = _request(request)
    # refused here, as hedged_infer.delay() refuses it, rather than by the worker after a send
    check_request(body, process_settings.current().race.request_max_bytes)
    cfg = root_config()
    names = [n.strip() for n in providers.split(",")] if providers else None
    spec = build_spec(cfg, policy, names, budget_key=budget_key)
    lines, worst = worst_case(spec, cfg.budget, cfg)
    gate(go, [f"would race a {len(json.dumps(body))}-byte request", *lines], worst)
    check_redis()
    return partial(
        send_race, body, policy=policy, providers=names, budget_key=budget_key, timeout_s=timeout_s
    )


@click.command(name="race")
@race_options
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def command(as_json: bool, **ask: Any) -> None:
    """Race REQUEST (a JSON object) on the workers; a dry run unless --go."""
    send = gated_race(**ask)

    try:
        out = send()
    except RaceFailed as e:
        click.echo(f"race {e.race_id} failed ({e.reason}): {e}", err=True)
        raise click.exceptions.Exit(1) from None
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        click.echo(
            f"race {out['race_id']}: {out['winner']} won in {out['e2e_ms']:.0f} ms "
            f"({'hedged' if out['hedged'] else 'not hedged'}); "
            f"gpuhedge-celery receipt {out['race_id']}"
        )
