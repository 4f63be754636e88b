"""What metrics cost a race: the same capacity run with metrics off and on, in alternating pairs.

``gpuhedge-celery bench races --rows metrics`` starts a fresh set of workers for each run:
metrics off (``GPUHEDGE_METRICS=0``: every hook returns at once), or on with each worker serving
its endpoint (multiprocess mode) while a scraper reads every endpoint once a second, as a
Prometheus with a 1 s scrape interval would (15 s is the usual interval: this is the heavier
case). The runs alternate (off, on, on, off, ...) so a machine whose speed drifts during the
run favours neither side; each pair's ratio and the median of the pairs are reported.
"""

from __future__ import annotations

import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from ._pairs import alternating_sides


class Scraper:
    """Reads ``http://127.0.0.1:<port>/metrics`` of each port every ``interval_s`` (a thread)."""

    def __init__(self, ports: list[int], interval_s: float = 1.0):
        self.ports = list(ports)
        self.interval_s = interval_s
        self.scrapes = 0
        self.failures = 0
        self.bytes = 0
        self.wall_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-scraper", daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for port in self.ports:
                try:
                    url = f"http://127.0.0.1:{port}/metrics"
                    t0 = time.perf_counter()
                    with urllib.request.urlopen(url, timeout=5) as r:
                        self.bytes += len(r.read())
                    self.wall_s += time.perf_counter() - t0
                    self.scrapes += 1
                except OSError:
                    self.failures += 1


def metrics_row(
    cluster: Callable[[bool, float], Any],
    capacity_row: Callable[..., dict[str, Any]],
    races: int,
    duration_s: float,
    pairs: int,
    seed: int,
) -> dict[str, Any]:
    """The capacity row (``capacity_row(bench, races, scale, seed)``) on a fresh
    ``cluster(metrics_on, scale)`` per run, off and on alternating."""
    scale = duration_s / 30.0

    def run(on: bool) -> dict[str, Any]:
        with cluster(on, scale) as bench:
            scraper = Scraper(bench.metrics_ports) if on else None
            with scraper or nullcontext():
                row = capacity_row(bench, races, scale, seed)
        if scraper is not None:
            row["scrapes"], row["scrape_failures"] = scraper.scrapes, scraper.failures
            row["scrape_wall_ms"] = round(1000.0 * scraper.wall_s / max(1, scraper.scrapes), 2)
            row["scrape_bytes"] = scraper.bytes // max(1, scraper.scrapes)
        return row

    summary = alternating_pairs(run, pairs)
    summary.update(races=races, duration_s=duration_s, hook_us=hook_costs())
    return summary


def hook_costs(n: int = 20_000) -> dict[str, float]:
    """Microseconds per call of three hooks in this process (metrics in memory, as in a
    coordination worker), each with label values it has seen before."""
    from types import SimpleNamespace

    from ..metrics import record

    if not record.active():
        return {}
    race = SimpleNamespace(policy=SimpleNamespace(kind="hedge"))
    attempt = SimpleNamespace(provider="p")
    calls = {
        "provider_call": lambda: record.provider_call("bench", "status"),
        "timer_fired": lambda: record.timer_fired({"kind": "watch"}, 0.002),
        "race_event": lambda: record.race_event("hedge_launched", race, attempt),
    }
    found = {}
    for name, call in calls.items():
        call()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        found[name] = round((time.perf_counter() - t0) / n * 1e6, 2)
    return found


def alternating_pairs(run: Callable[[bool], dict[str, Any]], pairs: int) -> dict[str, Any]:
    """``run(metrics_on)`` ``2 * pairs`` times, alternating which side goes first; a summary
    of CPU per race (workers, Redis and the bench client together) on each side."""
    runs: list[dict[str, Any]] = []
    for i, on in alternating_sides(pairs):
        row = run(on)
        runs.append(
            {
                "pair": i + 1,
                "metrics": "on" if on else "off",
                "cpu_ms_per_race": row["cpu_ms_per_race"],
                "cpu_ms_per_race_by": row["cpu_ms_per_race_by"],
                "timer_lag_p99_ms": row["timer_lag_ms"]["p99_ms"],
                "finished": row["finished"],
                "races": row["races"],
                **(
                    {
                        k: row[k]
                        for k in ("scrapes", "scrape_failures", "scrape_wall_ms", "scrape_bytes")
                    }
                    if on
                    else {}
                ),
            }
        )
    off_cpu = [r["cpu_ms_per_race"] for r in runs if r["metrics"] == "off"]
    on_cpu = [r["cpu_ms_per_race"] for r in runs if r["metrics"] == "on"]
    ratios = [b / a - 1.0 for a, b in zip(_side(runs, "off"), _side(runs, "on"), strict=True)]
    return {
        "row": "metrics",
        "pairs": pairs,
        "cpu_ms_per_race_off": {"median": round(statistics.median(off_cpu), 2), "runs": off_cpu},
        "cpu_ms_per_race_on": {"median": round(statistics.median(on_cpu), 2), "runs": on_cpu},
        "extra_cpu_per_pair_pct": [round(100.0 * r, 1) for r in ratios],
        "extra_cpu_median_pct": round(100.0 * statistics.median(ratios), 1),
        "runs": runs,
        "what": "capacity row with metrics off (GPUHEDGE_METRICS=0) and on (each worker's "
        "endpoint scraped every second), alternating; CPU of workers, Redis and client",
    }


def _side(runs: list[dict[str, Any]], side: str) -> list[float]:
    """CPU per race of one side, in pair order."""
    return [
        r["cpu_ms_per_race"] for r in sorted(runs, key=lambda r: r["pair"]) if r["metrics"] == side
    ]
