"""``gpuhedge-celery report FILE...``: latency, misses, hedging, cost and leaks of live requests.

Reads our exported race records (``records export``) and GPUHedge's live-record JSONL, groups
the requests (``--by policy|provider|budget-key|arm``) and prints one row per group: n; p50,
p90, p95 and p99, nearest-rank and linear side by side; the deadline-miss rate with a Wilson 95 %
interval; the hedge rate; $ per request (active and billed); wasted $; leaks. ``--plot DIR``
writes a latency CDF and a box plot per group. The statistics: :mod:`gpuhedge_celery.core.report`.
"""

from __future__ import annotations

import gc
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import orjson

from ..core.report import (
    BY_CHOICES,
    GPUHEDGE,
    OURS,
    RecordError,
    Request,
    RequestSet,
    grouped,
    summarise,
)


class BadInput(click.ClickException):
    """A one-line input error (exit code 2)."""

    exit_code = 2


@dataclass
class Loaded:
    """What the files held: the requests and what was left out."""

    requests: list[Request]
    skipped: dict[str, int]
    duplicates: int
    files: list[str]

    def sources(self) -> dict[str, int]:
        counts = {OURS: 0, GPUHEDGE: 0}
        for r in self.requests:
            counts[r.source] += 1
        return counts


def _lines(path: str) -> Iterator[tuple[str, Any]]:
    try:
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{number}", orjson.loads(line)
                except orjson.JSONDecodeError as e:
                    raise BadInput(f"{path}:{number}: not JSON ({e})") from None
    except OSError as e:
        raise BadInput(f"cannot read {path!r}: {e.strerror}") from None


def load_files(paths: Sequence[str]) -> Loaded:
    """Read every file (JSONL, either format); one-line errors name the file and line."""
    found = RequestSet()
    # Parsing makes millions of objects the cyclic collector would walk again and again.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for path in paths:
            found.add(_lines(path))
    except RecordError as e:
        raise BadInput(str(e)) from None
    finally:
        if collecting:
            gc.enable()
    return Loaded(found.requests(), dict(found.skipped), found.duplicates, list(paths))


def _s(value: float | None) -> str:
    if value is None or math.isinf(value):
        return "inf"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _usd(value: float | None, digits: int = 5) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_table(rows: Sequence[dict[str, Any]], by: str, deadlines: Sequence[float]) -> list[str]:
    """The report's table: one line per group (latencies in seconds)."""
    width = max([len(by), *(len(r["group"]) for r in rows)])
    width = min(width, 48)
    misses_head = " ".join(f"{f'miss>{d:g}s (Wilson 95%)':>25}" for d in deadlines)
    head = (
        f"{by:<{width}} {'n':>6} "
        + " ".join(f"{f'p{q} s nr/lin':>15}" for q in (50, 90, 95, 99))
        + f" {misses_head} {'hedged':>7} {'active $/req':>12} {'billed $/req':>12}"
        f" {'wasted $':>9} {'leaks':>5}"
    )
    lines = [head]
    for r in rows:
        pcts = " ".join(
            f"{_s(r[f'p{q}_s']) + '/' + _s(r[f'p{q}_linear_s']):>15}" for q in (50, 90, 95, 99)
        )
        miss = []
        for d in deadlines:
            label = format(d, "g")
            lo, hi = r["miss_ci"][label]
            cell = f"{r['misses'][label]}/{r['n']} ({lo * 100:.0f}-{hi * 100:.0f}%)"
            miss.append(f"{cell:>25}")
        leaks = "n/a" if r["leaks"] is None else str(r["leaks"])
        name = r["group"] if len(r["group"]) <= width else r["group"][: width - 1] + "~"
        lines.append(
            f"{name:<{width}} {r['n']:>6} {pcts} {' '.join(miss)} "
            f"{r['hedge_rate'] * 100:>6.0f}% {_usd(r['active_usd_per_request']):>12} "
            f"{_usd(r['billed_usd_per_request']):>12} {_usd(r['wasted_usd'], 4):>9} {leaks:>5}"
        )
    return lines


def format_report(
    loaded: Loaded, rows: Sequence[dict[str, Any]], by: str, deadlines: Sequence[float]
) -> str:
    sources = loaded.sources()
    lines = [
        f"{len(loaded.requests)} requests from {len(loaded.files)} file(s): "
        f"{sources[OURS]} gpuhedge-celery race records, {sources[GPUHEDGE]} GPUHedge live records"
    ]
    if loaded.skipped:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(loaded.skipped.items()))
        skipped = sum(loaded.skipped.values())
        lines.append(f"skipped {skipped} records that are not requests ({kinds})")
    if loaded.duplicates:
        lines.append(f"{loaded.duplicates} repeated race record(s): each race's last one counts")
    lines.append(
        "latency in seconds, nearest-rank/linear; a failed request is +inf (sorted last, a miss); "
        "$ n/a: not in the records"
    )
    lines.append("")
    lines += format_table(rows, by, deadlines)
    return "\n".join(lines)


def finite_json(value: Any) -> Any:
    """``value`` with every infinite float as None (JSON has no infinity)."""
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_json(v) for v in value]
    return value


def write_plots(
    directory: str,
    requests: Sequence[Request],
    by: str,
    deadlines: Sequence[float],
    *,
    scale: float = 1.0,
    unit: str = "s",
) -> list[Path]:
    """``latency_cdf.png`` and ``latency_box.png`` under ``directory`` (latencies x ``scale``)."""
    from ._plots import write_box, write_cdf

    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"cannot create plot directory {directory!r}: {e.strerror}") from None
    groups = {k: [r.latency_s * scale for r in rs] for k, rs in grouped(requests, by).items()}
    cdf, box = out / "latency_cdf.png", out / "latency_box.png"
    n = len(requests)
    write_cdf(cdf, groups, deadlines, f"Latency CDF by {by} (n = {n})", unit=unit)
    write_box(box, groups, deadlines, f"Latency by {by} (n = {n})", unit=unit)
    return [cdf, box]


@click.command("report")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option(
    "--by",
    type=click.Choice(BY_CHOICES),
    default="policy",
    show_default=True,
    help="Group requests by policy, winning provider, budget key or experiment arm.",
)
@click.option(
    "--deadline",
    "deadlines",
    type=float,
    multiple=True,
    metavar="S",
    help="Deadline in seconds for the miss rate, repeatable (default 60).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option(
    "--plot",
    "plot_dir",
    default=None,
    metavar="DIR",
    help="Write latency_cdf.png and latency_box.png (one curve / box per group) here.",
)
def command(
    files: tuple[str, ...],
    by: str,
    deadlines: tuple[float, ...],
    as_json: bool,
    plot_dir: str | None,
) -> None:
    """Summarise request records in FILES: our exported race records and GPUHedge's live JSONL."""
    deadline_list = list(deadlines) or [60.0]
    if any(d <= 0 or math.isinf(d) or math.isnan(d) for d in deadline_list):
        raise BadInput("--deadline must be a positive number of seconds")
    loaded = load_files(files)
    if not loaded.requests:
        raise BadInput(f"no requests in {', '.join(files)} (skipped: {loaded.skipped or 'none'})")
    rows = summarise(loaded.requests, by, deadline_list)
    written = write_plots(plot_dir, loaded.requests, by, deadline_list) if plot_dir else []
    if as_json:
        doc = {
            "by": by,
            "deadlines_s": deadline_list,
            "files": loaded.files,
            "requests": len(loaded.requests),
            "sources": loaded.sources(),
            "skipped": loaded.skipped,
            "duplicates": loaded.duplicates,
            "groups": finite_json(rows),
        }
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(format_report(loaded, rows, by, deadline_list))
    for path in written:
        click.echo(f"wrote {path}", err=True)
