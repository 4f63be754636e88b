"""The two coordination loops side by side: ``bench races --rows loop``.

The capacity row on fresh workers for each run, with ``GPUHEDGE_COORD_LOOP=threads`` (each
due timer on a timer thread) and ``batched`` (each claimed batch of watch polls stepped in
memory and saved in one round trip; docs/architecture.md), in alternating pairs (threads
first, then batched first, ...) so a machine whose speed drifts favours neither side.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from ._pairs import alternating_sides

LOOPS = ("threads", "batched")
KEPT = ("cpu_ms_per_race", "cpu_ms_per_race_by", "round_trips_per_race",
        "coordination_round_trips_per_race", "redis_bytes_per_race", "concurrent_peak",
        "started_peak", "finished", "won", "leaks", "races")  # fmt: skip


def loop_row(
    cluster: Callable[[str, float], Any],
    capacity_row: Callable[..., dict[str, Any]],
    races: int,
    scale: float,
    pairs: int,
    seed: int,
    ramp_s: float | None = None,
) -> dict[str, Any]:
    """``capacity_row(bench, races, scale, seed, ramp_s)`` on ``cluster(loop, scale)``, fresh
    for each run, ``pairs`` times per loop in alternating order; medians per loop."""
    runs: list[dict[str, Any]] = []
    for pair, batched in alternating_sides(pairs):
        loop = LOOPS[batched]
        with cluster(loop, scale) as bench:
            row = capacity_row(bench, races, scale, seed, ramp_s)
        lag = row["timer_lag_ms"]
        run = {"pair": pair + 1, "loop": loop, **{k: row[k] for k in KEPT}}
        run.update(timer_lag_p50_ms=lag["p50_ms"], timer_lag_p99_ms=lag["p99_ms"])
        runs.append(run)
    summary: dict[str, Any] = {"row": "loop", "races": races, "pairs": pairs}
    for loop in LOOPS:
        side = [r for r in runs if r["loop"] == loop]
        summary[loop] = {
            key: round(statistics.median(r[key] for r in side), 2)
            for key in (
                "cpu_ms_per_race",
                "round_trips_per_race",
                "coordination_round_trips_per_race",
                "redis_bytes_per_race",
                "timer_lag_p50_ms",
                "timer_lag_p99_ms",
            )  # fmt: skip
        }
    summary["runs"] = runs
    summary["what"] = (
        "capacity row with GPUHEDGE_COORD_LOOP=threads and =batched, fresh workers per run, "
        "alternating pairs; medians per loop (CPU of workers, Redis and client)"
    )
    return summary
