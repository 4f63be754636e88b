"""``gpuhedge-celery leases``: the GPU lease table, TTL advice and Redis event set-up."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import click

from ..core.lease_rules import DEFAULT_MARGIN, DEFAULT_PERCENTILE, suggest_ttl
from ..errors import ConfigError

COLUMNS = (
    "GPU",
    "POOL",
    "HOST",
    "STATE",
    "HOLDER",
    "TOKEN",
    "TTL LEFT",
    "RUNNING SINCE",
    "IN POOL",
    "HEALTH",
)


def _settings():
    return click.get_current_context().find_root().obj.settings


def _store():
    """A lease store for the CLI (fails fast when Redis is down)."""
    from ..cli import cli_redis_client
    from ..store.leases import LeaseStore

    return LeaseStore(cli_redis_client(), prefix=_settings().prefix)


def _iso(ms: int | None) -> str | None:
    if not ms:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="seconds")


def _since_text(ms: int | None, now_s: float) -> str:
    if not ms:
        return "-"
    age = max(0.0, now_s - ms / 1000)
    return f"{_iso(ms)} ({age:.0f} s ago)"


@click.group(name="leases", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
@click.option("--pool", default=None, help="Only this pool's GPUs.")
@click.pass_context
def command(ctx: click.Context, as_json: bool, pool: str | None) -> None:
    """Show the lease table: GPU, pool, state (free/held/stale), holder, token, TTL left, since,
    whether the GPU takes new leases (draining, drained, out: and why) and its health."""
    if ctx.invoked_subcommand is not None:
        return
    rows = _store().table(pool)
    if as_json:
        gpus = [dict(r.to_dict(), since=_iso(r.since_ms)) for r in rows]
        click.echo(json.dumps({"pool": pool, "gpus": gpus}, indent=2))
        return
    if not rows:
        click.echo("no GPU is registered")
        return
    for line in lease_table(rows, time.time()):
        click.echo(line)


def in_pool_text(row) -> str:
    """``yes``, or ``draining``/``drained``/``out`` and why (each reason's detail)."""
    if not row.out:
        return "yes"
    return f"{row.availability}: " + "; ".join(r["detail"] for r in row.out.values())


def health_text(health: dict | None) -> str:
    """A GPU's last health sample in a few words (``-``: no recent sample, e.g. no NVML)."""
    if not health:
        return "-"
    if health.get("error"):
        return f"unknown: {health['error']}"
    used, total = health.get("memory_used_mb"), health.get("memory_total_mb")
    parts = []
    if used is not None and total:
        parts.append(f"mem {used / 1024:.1f}/{total / 1024:.1f} GiB")
    if health.get("utilization_pct") is not None:
        parts.append(f"util {health['utilization_pct']}%")
    procs = health.get("processes") or []
    foreign = [p for p in procs if not p.get("ours")]
    parts.append(f"{len(procs)} proc" + (f" ({len(foreign)} foreign)" if foreign else ""))
    if health.get("ecc_uncorrected"):
        parts.append(f"ECC {health['ecc_uncorrected']}")
    if health.get("xids"):
        parts.append("Xid " + ",".join(str(x) for x in health["xids"]))
    return ", ".join(parts)


def lease_table(rows: list, now_s: float, columns: tuple[str, ...] = COLUMNS) -> list[str]:
    """The lease table's lines (header first), each column as wide as its widest cell;
    ``columns``: which of :data:`COLUMNS` to show, in that order."""
    table = [columns]
    for r in rows:
        ttl = f"{r.ttl_left_ms / 1000:.1f} s" if r.ttl_left_ms is not None else "-"
        cells = {
            "GPU": r.gpu_id,
            "POOL": r.pool,
            "HOST": f"{r.host} ({'live' if r.host_live else 'down'})",
            "STATE": r.state,
            "HOLDER": r.holder or "-",
            "TOKEN": str(r.token) if r.token is not None else "-",
            "TTL LEFT": ttl,
            "RUNNING SINCE": _since_text(r.since_ms, now_s),
            "IN POOL": in_pool_text(r),
            "HEALTH": health_text(r.health),
        }
        table.append(tuple(cells[c] for c in columns))
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table
    ]


def read_durations(path: str) -> list[float]:
    """Job durations in seconds from ``path``: a JSON list, or one number or JSON object per line
    (objects give ``duration_s``, ``seconds`` or ``duration``)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read durations: {e.strerror}", file=path) from None
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise ConfigError(f"not a JSON list of numbers ({e.msg})", file=path) from None
        lines = [(i + 1, item) for i, item in enumerate(items)]
    else:
        lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    found = []
    for n, item in lines:
        found.append(_duration(item, path, n))
    return found


def _duration(item: object, path: str, n: int) -> float:
    where = f"item {n}" if not isinstance(item, str) else f"line {n}"
    value = item
    if isinstance(item, str):
        try:
            value = json.loads(item)
        except json.JSONDecodeError:
            value = item
    if isinstance(value, dict):
        value = next((value[k] for k in ("duration_s", "seconds", "duration") if k in value), None)
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(
            f"expected a duration in seconds (a number, or an object with duration_s), "
            f"got {str(item)[:60]!r}",
            file=path,
            key=where,
        ) from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ConfigError(f"expected a finite duration >= 0 s, got {seconds}", file=path, key=where)
    return seconds


@command.command("suggest-ttl")
@click.option("--from", "from_file", type=str, default=None, help="File of job durations (s).")
@click.option("--pool", default=None, help="Use the job durations recorded for this pool.")
@click.option("--percentile", "pct", type=float, default=DEFAULT_PERCENTILE, show_default=True)
@click.option("--margin", type=float, default=DEFAULT_MARGIN, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the suggestion as JSON.")
def suggest_ttl_command(
    from_file: str | None, pool: str | None, pct: float, margin: float, as_json: bool
) -> None:
    """Recommend a lease TTL from recorded job durations, and say why."""
    if (from_file is None) == (pool is None):
        raise ConfigError("give exactly one of --from FILE or --pool POOL", key="suggest-ttl")
    if from_file is not None:
        durations, source = read_durations(from_file), f"file {from_file}"
    else:
        durations, source = _store().durations(pool), f"pool {pool!r}"
        if not durations:
            raise ConfigError(
                f"no job durations are recorded for pool {pool!r} yet; run jobs first "
                "or pass --from FILE",
                key="--pool",
            )
    try:
        s = suggest_ttl(durations, pct=pct, margin=margin)
    except ValueError as e:
        raise ConfigError(str(e), file=from_file, key=None if from_file else "--pool") from None
    if as_json:
        click.echo(json.dumps({"source": source, **s.to_dict()}, indent=2))
        return
    click.echo(f"suggested lease TTL ({source}): {s.ttl_ms} ms")
    click.echo(f"why: {s.reason}")
    click.echo(f"median {s.median_s:.3f} s, max {s.max_s:.3f} s over {s.samples} jobs")
    target = pool or "POOL"
    click.echo(f"apply: gpuhedge-celery leases set-ttl --pool {target} --ttl-ms {s.ttl_ms}")


@command.command("set-ttl")
@click.option("--pool", required=True, help="Pool whose lease TTL to set.")
@click.option("--ttl-ms", "ttl_ms", type=int, required=True, help="Lease TTL in ms (> 0).")
def set_ttl_command(pool: str, ttl_ms: int) -> None:
    """Set a pool's lease TTL (choose it with suggest-ttl)."""
    _store().set_pool_ttl(pool, ttl_ms)
    click.echo(f"pool {pool!r}: lease TTL {ttl_ms} ms")


@command.command("enable-events")
def enable_events_command() -> None:
    """Turn on the keyspace notifications waiters wake on (adds E, g, x to existing flags)."""
    from ..store.listener import require_notifications

    store = _store()
    with store.guard():
        require_notifications(store.client)
        flags = store.client.config_get("notify-keyspace-events")["notify-keyspace-events"]
    click.echo(f"keyspace notifications on ({store.where}): notify-keyspace-events={flags}")
