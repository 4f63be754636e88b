"""``gpuhedge-celery receipt RACE_ID [--json]``: a race's full audit, read from Redis by race id.

The race id is the ``hedged_infer`` task id, or any prefix of it that names one race (such as
the 12 characters ``gpuhedge-celery watch`` prints). A finished race shows its stored receipt
(kept ``GPUHEDGE_RECEIPT_TTL_S``); a race still in flight shows a provisional one (``finished``
false). Exit codes: 0 found, 1 no such race (unknown or expired) or an ambiguous prefix, 2 a
malformed id, 3 Redis unreachable.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import click

from ..errors import ConfigError, GpuHedgeError


def _store() -> Any:
    """A race store for the CLI (fails fast when Redis is down)."""
    from ..cli import cli_redis_client, root_settings
    from ..settings import current
    from ..store.races import RaceStore

    root = root_settings()
    shards = current().race_shards(root.prefix, root.redis_url)
    return RaceStore(cli_redis_client(), shards)


def _when(epoch_s: float | None) -> str:
    if not epoch_s:
        return "-"
    return datetime.fromtimestamp(epoch_s, tz=timezone.utc).isoformat(timespec="milliseconds")


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:.6f}"


def _latency(receipt: dict[str, Any]) -> str:
    lat, scale = receipt.get("latency_ms"), float(receipt.get("time_scale") or 1.0)
    if lat is None:
        return "-"
    if scale == 1.0:
        return f"{lat / 1000:.3f} s from the primary's submit"
    return (
        f"{lat / 1000 / scale:.1f} s simulated from the primary's submit ({lat / 1000:.3f} s "
        f"real: time_scale {scale:g}, simulated time runs {1 / scale:g}x fast)"
    )


def render(receipt: dict[str, Any]) -> str:
    """The receipt as a short human-readable report, in seconds throughout.

    A compressed simulation's receipt (``time_scale`` below 1, like the demo's) shows its
    times as simulated provider seconds, as the demo narrates them, and says so.
    """
    scale = float(receipt.get("time_scale") or 1.0)
    names = ("hedged", "cut_over", "cutover_late", "escalated", "budget_refused", "leaked")
    flags = [f for f in names if receipt.get(f)]
    lines = [
        f"race      {receipt['race_id']}" + ("" if receipt.get("finished") else "  (in flight)"),
        f"policy    {receipt.get('policy')}"
        + ("" if scale == 1.0 else " (its timers in real seconds)"),
        f"winner    {receipt.get('winner_provider') or 'none'}"
        + (f" ({receipt['winner']})" if receipt.get("winner") else f": {receipt.get('note')}"),
        f"latency   {_latency(receipt)}",
        f"flags     {', '.join(flags) or '-'}",
        f"cost      active {_usd(receipt.get('active_usd'))}, billed "
        f"{_usd(receipt.get('billed_usd'))}, wasted {_usd(receipt.get('wasted_usd'))}",
        f"created   {_when(receipt.get('created_at'))}",
        f"finished  {_when(receipt.get('finished_at'))}",
    ]
    if receipt.get("stopped_by"):
        lines.append(f"stopped   {_when(receipt.get('stopped_at'))} by {receipt['stopped_by']}")
    lines += ["", "attempts:"]
    for a in receipt.get("attempts", []):
        unsent = a.get("sent") is False  # never reached its provider: no job, no cancel
        valid = "-" if unsent else {True: "valid", False: "invalid", None: "-"}[a.get("valid")]
        state = "not sent" if unsent else a.get("state") or "-"
        lines.append(
            f"  {a['id']} {a['role']:<8} {a['provider']:<14} {state:<11} "
            f"{valid:<7} job {a.get('job_id') or '-'}"
        )
        if scale == 1.0:
            steps = ", ".join(f"{t:.3f}s {label}" for t, label in a.get("timeline", []))
            lines.append(f"     timeline: {steps}")
        else:
            steps = ", ".join(f"{t / scale:.1f}s {label}" for t, label in a.get("timeline", []))
            lines.append(f"     timeline (simulated s): {steps}")
        if unsent:
            lines.append(f"     not sent: {'; '.join(a.get('reasons') or []) or '-'}")
            continue
        if a.get("reasons") and a.get("valid") is False:
            lines.append(f"     reasons: {'; '.join(a['reasons'])}")
        c = a.get("cancel_receipt")
        if c:
            terminal = c.get("terminal_status") or "-"
            lines.append(
                f"     cancel: evidence {c['evidence']}, terminal {terminal},"
                f" scope {c['scope']}, leaked {str(c['leaked']).lower()}"
                + (f" ({c['note']})" if c.get("note") else "")
            )
    if receipt.get("leaks"):
        lines.append("")
        lines.append(
            "LEAKED (may still be billing): "
            + ", ".join(f"{x['provider']} job {x['job_id']}" for x in receipt["leaks"])
        )
    return "\n".join(lines)


MAX_SHOWN = 5  # race ids an ambiguous prefix lists


@click.command(name="receipt")
@click.argument("race_id")
@click.option("--json", "as_json", is_flag=True, help="Print the full receipt as JSON.")
def command(race_id: str, as_json: bool) -> None:
    """Show the receipt of a hedged race (RACE_ID: the hedged_infer task id, or a prefix of it
    naming one race, like the short ids `watch` prints)."""
    from ..race.receipt import read_receipt
    from ..store.connection import translate_errors
    from ..store.race_lookup import races_starting_with

    matches: list[str] = []
    try:
        store = _store()
        with translate_errors():
            found = read_receipt(store, race_id)
            if found is None:  # not a whole id: a prefix of one?
                matches = races_starting_with(store, race_id, limit=MAX_SHOWN + 1)
                if len(matches) == 1:
                    found = read_receipt(store, matches[0])
    except ValueError as e:  # a race id that could never be a key
        raise ConfigError(str(e), key="RACE_ID") from None
    if found is None and len(matches) > 1:
        more = len(matches) > MAX_SHOWN
        count = f"more than {MAX_SHOWN}" if more else str(len(matches))
        shown = ", ".join(matches[:MAX_SHOWN]) + (", ..." if more else "")
        raise GpuHedgeError(  # exit code 1 through the CLI's main()
            f"race id prefix {race_id!r} matches {count} races ({shown}): give more characters"
        )
    if found is None:
        raise GpuHedgeError(
            f"no race {race_id!r} under prefix {store.prefix!r} (no race id starts with it; "
            "unknown, or its receipt expired)"
        )
    click.echo(json.dumps(found, indent=2) if as_json else render(found))
