"""``gpuhedge-celery bench replay``: wall time and peak memory of the full default replay sweep."""

from __future__ import annotations

import json
import resource
import sys
import time
import tracemalloc
from pathlib import Path

import click

from ..core.replay import SUBSETS, default_policies, load_rounds, sweep

DEFAULT_TRACES = Path(__file__).resolve().parents[2] / "tests" / "data" / "moss_rounds.jsonl"


def _max_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB on Linux


@click.command("replay")
@click.option(
    "--traces",
    type=click.Path(dir_okay=False),
    default=None,
    help="Paired-round traces (default: tests/data/moss_rounds.jsonl of a source checkout).",
)
@click.option("--repeat", type=click.IntRange(1, 50), default=3, help="Timed runs (best and all).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the only format; kept for CI).")
def command(traces: str | None, repeat: int, as_json: bool) -> None:
    """Run the full default sweep (every policy family, all three subsets) and time it."""
    path = Path(traces) if traces else DEFAULT_TRACES
    if not path.is_file():
        raise click.ClickException(f"traces not found: {path} (pass --traces FILE)")
    walls = []
    rows = 0
    for _ in range(repeat):
        start = time.perf_counter()
        rounds = load_rounds(path)
        policies = [p for _, p in default_policies(rounds)]
        rows = len(sweep(rounds, policies, SUBSETS))
        walls.append(time.perf_counter() - start)
    # Peak memory is measured on a separate run: tracemalloc slows the timed ones down.
    tracemalloc.start()
    rounds = load_rounds(path)
    sweep(rounds, [p for _, p in default_policies(rounds)], SUBSETS)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    result = {
        "rows": rows,
        "rounds": len(rounds),
        "policies": len(policies),
        "wall_s": round(min(walls), 4),
        "wall_s_runs": [round(w, 4) for w in walls],
        "peak_mem_mb": round(peak / 2**20, 2),  # Python allocations during one sweep
        "max_rss_mb": round(_max_rss_mb(), 1),  # the whole process, interpreter included
    }
    click.echo(json.dumps({"bench": "replay", "results": [result]}))
