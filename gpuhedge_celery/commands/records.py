"""``gpuhedge-celery records``: the record stream of finished races (``docs/records.md``).

``records export [--since T] [--until T] > FILE.jsonl`` writes one compact JSON record per line,
oldest first, so they outlive the capped stream; ``report FILE...`` summarises them.
"""

from __future__ import annotations

import math
import sys
from datetime import datetime, timezone

import click

from ..cli import cli_redis_client, root_settings


class BadInput(click.ClickException):
    """A one-line usage error (exit code 2)."""

    exit_code = 2


def parse_time(text: str, option: str) -> float:
    """Epoch seconds from epoch seconds or an ISO-8601 time (UTC when it names no offset)."""
    raw = text.strip()
    try:
        value = float(raw)
    except ValueError:
        try:
            when = datetime.fromisoformat(raw.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise BadInput(
                f"bad {option} {text!r}: expected ISO-8601 (2026-07-12T11:59:21Z) or epoch seconds"
            ) from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        return when.timestamp()
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise BadInput(f"bad {option} {text!r}: expected epoch seconds >= 0")
    return value


@click.group("records")
def command() -> None:
    """Finished races' records, kept in a capped Redis stream (GPUHEDGE_RECORDS_MAXLEN)."""


@command.command("export")
@click.option(
    "--since",
    default=None,
    metavar="T",
    help="Only races finished at or after this time "
    "(ISO-8601, UTC without an offset; or epoch seconds).",
)
@click.option(
    "--until", default=None, metavar="T", help="Only races finished at or before this time."
)
def export(since: str | None, until: str | None) -> None:
    """Write the stream's records as JSONL to stdout (oldest first; a count to stderr)."""
    from ..settings import current
    from ..store import codec
    from ..store.records import RecordStream

    since_s = None if since is None else parse_time(since, "--since")
    until_s = None if until is None else parse_time(until, "--until")
    if since_s is not None and until_s is not None and until_s < since_s:
        raise BadInput(f"--until {until!r} is before --since {since!r}")
    root = root_settings()
    shards = current().race_shards(root.prefix, root.redis_url)  # every shard's stream
    stream = RecordStream(cli_redis_client(), root.prefix, shards=shards)
    out = sys.stdout
    count = 0
    for _, record in stream.read(
        None if since_s is None else int(since_s * 1000),
        None if until_s is None else int(until_s * 1000),
    ):
        out.write(codec.dumps(record))
        out.write("\n")
        count += 1
    out.flush()
    click.echo(f"exported {count} record(s) from {', '.join(stream.keys)}", err=True)
