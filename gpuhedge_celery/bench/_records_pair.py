"""``bench races --rows records``: CPU per race with race records on against off, side by side.

Each run is the capacity row (``races.capacity_row``: races started over a ramp, hedged half
way, CPU of workers, Redis and client per race) on a fresh cluster whose workers run with
``GPUHEDGE_RECORDS_MAXLEN=0`` (off) or the default cap (on). Runs alternate in pairs, the order
flipping every pair (off/on, on/off, ...), so a machine that drifts during the benchmark does
not favour one side. Each cluster first runs 20 zero-latency races to warm its workers.
Beside it, Redis's own CPU per ``XADD`` (``INFO commandstats``; server-wide, so exact on the
private redis-server the bench starts when one is installed).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from ..store.records import DEFAULT_RECORDS_MAXLEN, RecordStream
from ._pairs import alternating_sides

WARM_RACES = 20


def _warm(bench: Any, stream: RecordStream) -> None:
    zero = {"sim": {"p": {"queue_s": 0, "run_s": 0}}}
    for _ in range(WARM_RACES):
        bench.send(zero, policy="single", providers=["p"]).get(timeout=30)
    # .get() returns when the winner is known; the record follows with the receipt
    deadline = time.monotonic() + 10
    while stream.enabled and stream.length() < WARM_RACES and time.monotonic() < deadline:
        time.sleep(0.01)


def _recorded(stream: RecordStream) -> list[tuple[str, Any]]:
    """``(race id, finish time)`` of every record in the stream, oldest first."""
    return [(str(record.get("race_id")), record.get("ts")) for _entry, record in stream.read()]


def _tally(entries: list[tuple[str, Any]]) -> dict[str, int]:
    """Entries written during a row: races recorded, and each race's later entries told apart.

    A race's receipt rewritten after its finish (a capped job's late cancel) appends a corrected
    record with the same finish time; a second record with another finish time means the race
    was finished twice, which must not happen.
    """
    first: dict[str, Any] = {}
    rewritten = twice = 0
    for race, ts in entries:
        if race not in first:
            first[race] = ts
        elif ts == first[race]:
            rewritten += 1
        else:
            twice += 1
    return {
        "records_written": len(entries),
        "races_recorded": len(first),
        "records_rewritten": rewritten,
        "races_finished_twice": twice,
    }


def records_row(
    bench_cluster: Callable[..., Any],
    capacity_row: Callable[..., dict[str, Any]],
    url: str | None,
    workers: int,
    concurrency: int,
    scale: float,
    races: int,
    pairs: int,
    seed: int,
    ramp_s: float | None,
) -> dict[str, Any]:
    """``pairs`` off/on pairs of capacity runs of ``races`` races; CPU per race of each side.

    ``bench_cluster`` and ``capacity_row`` are :mod:`.races`' own (passed in: that module
    imports this one).
    """

    runs: list[dict[str, Any]] = []
    for pair, on in alternating_sides(pairs):
        maxlen = DEFAULT_RECORDS_MAXLEN if on else 0
        env = {"GPUHEDGE_RECORDS_MAXLEN": str(maxlen)}
        with bench_cluster(url, workers, concurrency, scale, extra_env=env) as bench:
            stream = RecordStream(bench.client, bench.prefix, maxlen)
            _warm(bench, stream)
            before = stream.length()  # the stream is only appended to during the row
            row = capacity_row(bench, races, scale, seed + pair, ramp_s)
            tally = _tally(_recorded(stream)[before:])
            xadd = bench.client.info("commandstats").get("cmdstat_xadd") or {}
        runs.append(
            {
                "pair": pair + 1,
                "records": "on" if on else "off",
                **tally,  # readers keep the last record of each race (docs/records.md)
                "finished": row["finished"],
                "cpu_ms_per_race": row["cpu_ms_per_race"],
                "cpu_ms_per_race_by": row["cpu_ms_per_race_by"],
                "timer_lag_p99_ms": row["timer_lag_ms"]["p99_ms"],
                "concurrent_peak": row["concurrent_peak"],
                # Redis's own CPU per XADD (its server-wide command statistics)
                "redis_xadd_usec_per_call": xadd.get("usec_per_call"),
            }
        )
    off_cpu = [r["cpu_ms_per_race"] for r in runs if r["records"] == "off"]
    on_cpu = [r["cpu_ms_per_race"] for r in runs if r["records"] == "on"]
    deltas = [round(b - a, 2) for a, b in zip(off_cpu, on_cpu, strict=True)]  # on - off, per pair
    mean_off, mean_on = statistics.fmean(off_cpu), statistics.fmean(on_cpu)
    return {
        "row": "records",
        "races": races,
        "pairs": pairs,
        "cpu_ms_per_race_off": round(mean_off, 2),
        "cpu_ms_per_race_on": round(mean_on, 2),
        "delta_ms": round(mean_on - mean_off, 2),
        "delta_pct": round(100.0 * (mean_on - mean_off) / mean_off, 1),
        "pair_deltas_ms": deltas,
        "runs": runs,
        "what": "capacity row's CPU per race (workers + Redis + client) with race records on "
        "(GPUHEDGE_RECORDS_MAXLEN default) and off (0), alternating pairs of fresh clusters",
    }
