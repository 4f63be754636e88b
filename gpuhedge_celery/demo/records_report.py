"""The demo's last section: the ``report`` table of every race it ran, read from their records.

Every finished race appended a record to the demo prefix's record stream; this reads them back
and prints what ``gpuhedge-celery report`` prints for an exported file, by policy. The demo
compresses time, so latencies are shown in simulated provider seconds (real seconds divided by
the config's ``time_scale``) like the rest of the demo; costs are already priced in provider
time. ``demo --plot DIR`` also writes the report's plots there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

Echo = Callable[[str], None]


def records_report(
    redis_url: str,
    prefix: str,
    time_scale: float,
    deadlines: Sequence[float],
    echo: Echo,
    plot_dir: str | None = None,
) -> list[dict[str, Any]]:
    """Print the report table of the races recorded under ``prefix``; return its rows (JSON)."""
    from ..commands.report import finite_json, format_table, write_plots
    from ..core.report import RequestSet, summarise
    from ..settings import current
    from ..store.connection import client_for
    from ..store.records import RecordStream

    shards = current().race_shards(prefix, redis_url)  # where the demo's workers wrote them
    stream = RecordStream(client_for(redis_url), prefix, shards=shards)
    found = RequestSet()
    found.add((f"{key} {entry_id}", record) for key, entry_id, record in stream.entries())
    requests = found.requests()
    echo("== 5. The report of every race above, from their records (gpuhedge-celery report) ==")
    if not requests:
        echo("  no race records found (GPUHEDGE_RECORDS_MAXLEN=0 turns them off)\n")
        return []
    for r in requests:  # provider seconds, as in the rest of the demo
        if not math.isinf(r.latency_s):
            r.latency_s /= time_scale
    rows = summarise(requests, "policy", deadlines)
    echo(
        f"  {len(requests)} races; latency in simulated provider seconds, nearest-rank/linear; "
        "a failed race counts as +inf;\n  policy names carry the compressed (real-time) timings "
        "the races ran with"
    )
    for line in format_table(rows, "policy", deadlines):
        echo("  " + line)
    echo(
        "  outside the demo: gpuhedge-celery records export > races.jsonl; "
        "gpuhedge-celery report races.jsonl"
    )
    if plot_dir:
        for path in write_plots(plot_dir, requests, "policy", deadlines, unit="provider s"):
            echo(f"  wrote {path}")
    echo("")
    return finite_json(rows)
