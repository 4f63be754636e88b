"""``gpuhedge-celery watch [--once] [--json]``: a live terminal table of hedged races in flight.

Reads what any coordinator writes to Redis, so it watches the whole deployment from anywhere:
the heartbeat indexes of every race shard (``<prefix>:{<shard>}:live``) list the races (with
``--all``, also the recently finished ones of ``<prefix>:{<shard>}:finished``), each race's
state gives its attempts (provider, phase, last provider state), pending policy timers and
winner, and its live job index and cancel receipts give the leaks. ``--once`` prints one
snapshot (for scripts and tests); without it the table is redrawn in place every
``--interval`` seconds until Ctrl-C.
Exit codes: 0 ok, 2 bad option, 3 Redis unreachable.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from ..store.timers import as_text


def _store() -> Any:
    """A race store for the CLI (fails fast when Redis is down)."""
    from ..cli import cli_redis_client, root_settings
    from ..settings import current
    from ..store.races import RaceStore

    root = root_settings()
    shards = current().race_shards(root.prefix, root.redis_url)
    return RaceStore(cli_redis_client(), shards)


def _row(
    race_id: str,
    last_seen_ms: int,
    state: dict[str, Any] | None,
    jobs: dict,
    now: float,
    done: bool,
) -> dict[str, Any]:
    """One race as the table (and ``--json``) shows it."""
    if state is None:
        return {"race_id": race_id, "status": "expired", "live_jobs": sorted(jobs)}
    race = state["race"]
    started = race.get("started_at") or now
    attempts = []
    for a in race.get("attempts", []):
        receipt = a.get("receipt") or {}
        sent_at = a.get("cancel_sent_at")
        # a cancel decided and not yet answered: under the fleet's /cancel budget, it may be
        # waiting for a token while the job bills
        waiting = a["phase"] == "cancelling" and sent_at is not None
        attempts.append(
            {
                "id": a["id"],
                "provider": a["provider"],
                "role": a["role"],
                "phase": a["phase"],
                "state": a.get("last_state"),
                "job_id": a.get("job_id") or None,
                "live_job": a["id"] in jobs,
                "cancel_evidence": receipt.get("evidence"),
                "leaked": a["phase"] == "leaked" or bool(receipt.get("leaked") and done),
                "cancel_pending_ms": (
                    round((now - started - float(sent_at)) * 1000.0, 1) if waiting else None
                ),
                "token_wait_ms": receipt.get("token_wait_ms"),
            }
        )
    winner = race.get("winner")
    won = next((a for a in attempts if a["id"] == winner), None)
    if race.get("finished"):
        status = "finished" if won else "failed"
    else:
        status = "won" if won else "racing"
    return {
        "race_id": race_id,
        "status": status,
        "policy": race["policy"].get("kind"),
        "age_ms": round((now - started) * 1000.0, 1),
        "heartbeat_ms_ago": max(0, round(now * 1000.0 - last_seen_ms)),
        "attempts": attempts,
        "timers": {k: round((float(at) - now) * 1000.0, 1) for k, at in race["timers"].items()},
        "winner": won["provider"] if won else None,
        "leaks": [a["id"] for a in attempts if a["leaked"]],
        "flags": list(race.get("flags") or []),
        "note": race.get("note") or "",
    }


def snapshot(store: Any, limit: int = 100, *, include_finished: bool = False) -> dict[str, Any]:
    """The races of the heartbeat index (most recent first) as JSON-ready rows; with
    ``include_finished`` also the recently finished ones (their receipts' index)."""
    from ..store.race_lookup import recently_finished
    from ..store.race_parts import decode_fields, field
    from ..store.timers import store_errors

    now = time.time()
    latest: dict[str, int] = {}
    with store_errors("reading races in flight"):
        for index in store.shards.indexes:  # every shard's heartbeat index
            live = store.client.zrevrange(index.live, 0, limit - 1, withscores=True)
            latest.update((as_text(race_id), int(score)) for race_id, score in live)
    if include_finished:
        for race_id, finished_ms in recently_finished(store, limit):
            latest[race_id] = max(latest.get(race_id, 0), finished_ms)
    found = sorted(latest.items(), key=lambda item: item[1], reverse=True)[:limit]
    answers: dict[str, list[Any]] = {}
    with store_errors("reading races in flight"):
        for group in store.shards.by_shard(r for r, _ in found).values():  # a pipeline a slot
            pipe = store.client.pipeline(transaction=False)
            for race_id in group:
                keys = store.shards.race(race_id)
                pipe.hgetall(keys.state)
                pipe.hgetall(keys.jobs)
                pipe.exists(keys.receipt)
            replies = pipe.execute()
            answers.update((r, replies[3 * i : 3 * i + 3]) for i, r in enumerate(group))
    rows = []
    for race_id, score in found:
        fields, jobs, done = answers[race_id]
        has_state = fields and field(fields, "v") is not None  # else: expired
        state = decode_fields(fields) if has_state else None
        if state is None and not jobs:
            continue  # expired, and nothing of it is left running
        row = _row(race_id, score, state, jobs or {}, now, bool(done))
        if row["status"] in ("finished", "failed") and not row["leaks"] and not include_finished:
            continue  # lingering in the index with nothing left to watch
        rows.append(row)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return {"at": now, "prefix": store.prefix, "races": rows, "counts": counts}


def _attempt_cell(a: dict[str, Any]) -> str:
    state = a["state"] or "-"
    mark = " LEAK" if a["leaked"] else ""
    pending = a.get("cancel_pending_ms")
    if pending is not None:  # how long its cancel has been waiting (a token, an answer)
        mark += f" cancel+{pending / 1000:.1f}s"
    return f"{a['provider']}:{a['phase']}/{state}{mark}"


SHORT_ID = 12  # characters of a race id the table shows (``receipt`` accepts any unique prefix)


def short_ids(race_ids: list[str]) -> int:
    """How many leading characters tell the listed race ids apart (at least ``SHORT_ID``)."""
    width = SHORT_ID
    while len({r[:width] for r in race_ids}) < len(set(race_ids)):
        width += 1
    return width


COLUMNS = ("RACE", "STATUS", "POLICY", "AGE", "ATTEMPTS", "TIMERS", "WINNER", "LEAKS")


def render(snap: dict[str, Any]) -> str:
    """The snapshot as a table whose columns are as wide as their widest cell."""
    stamp = time.strftime("%H:%M:%S", time.localtime(snap["at"]))
    counts = ", ".join(f"{n} {s}" for s, n in sorted(snap["counts"].items())) or "none"
    title = f"gpuhedge races in flight  {stamp}  prefix {snap['prefix']}  ({counts})"
    width = short_ids([r["race_id"] for r in snap["races"]])
    table: list[tuple[str, ...]] = [COLUMNS]
    expired: list[str] = []
    for r in snap["races"]:
        if r["status"] == "expired":
            expired.append(
                f"{r['race_id'][:width]} expired  live jobs: {', '.join(r['live_jobs'])}"
            )
            continue
        table.append(
            (
                r["race_id"][:width],
                r["status"],
                r["policy"] or "-",
                f"{r['age_ms'] / 1000:.2f}s",
                " ".join(_attempt_cell(a) for a in r["attempts"]) or "-",
                " ".join(f"{k}@{ms / 1000:+.2f}s" for k, ms in r["timers"].items()) or "-",
                r["winner"] or "-",
                ",".join(r["leaks"]) or "-",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = [title]
    for row in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    lines.extend(expired)
    if not snap["races"]:
        lines.append("(no race in flight)")
    return "\n".join(lines)


@click.command(name="watch")
@click.option("--once", is_flag=True, help="Print one snapshot and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print snapshots as JSON (one per line).")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Seconds between refreshes.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1, max=10_000),
    default=50,
    show_default=True,
    help="Most races shown (the most recently active first).",
)
@click.option("--all", "include_finished", is_flag=True, help="Also show recently finished races.")
def command(once: bool, as_json: bool, interval: float, limit: int, include_finished: bool) -> None:
    """Watch hedged races in flight: provider states, timers, winner, leaks."""
    from ..store.connection import translate_errors

    store = _store()
    while True:
        with translate_errors():
            snap = snapshot(store, limit, include_finished=include_finished)
        if as_json:
            click.echo(json.dumps(snap))
        elif once:
            click.echo(render(snap))
        else:
            # Redraw in place: cursor home, clear the screen.
            click.echo("\x1b[H\x1b[2J" + render(snap), nl=True)
        if once:
            return
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return
