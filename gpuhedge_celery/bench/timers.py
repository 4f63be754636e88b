"""``gpuhedge-celery bench timers``: firing lag of durable timers under race-like load.

Each row arms ``--timers`` timers (three per race: hedge, cutover, safety) due over a window,
each armed 50 ms to 10 s before it is due (races of 5-30 s arm timers that far ahead; the peak
number waiting at once is ``pending_peak``), while ``--concurrency`` processes run a
:class:`TimerService` whose handler appends ``id due fired deliveries`` to a per-process file
(unbuffered, so the lines of a killed process survive); ``--threads`` is each service's number
of handler threads (1: handlers run one after another in the service thread). With
``--shards`` the races' timers are spread over that many race shards (a namespace each, as
``GPUHEDGE_RACE_SHARDS`` spreads a deployment's) and dealt over the processes as a
deployment's coordinators deal them (a service per shard held, sharing its ``--threads``).
Lag is fire time minus due time. The ``kill`` row SIGKILLs one firing process half-way through,
hung in a handler; its claimed timers must fire elsewhere after their lease (``lost`` must be
0; ``duplicates`` counts timers whose handler ran in the killed process just before it died and
ran again elsewhere: delivery is at least once), and the shards dealt to it only once it has
stalled or its coordinator lease has lapsed.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import resource
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, cast

import click

from ..store.connection import client_for, ping, translate_errors
from ..store.race_keys import MAX_SHARDS, RaceShards
from ..store.timer_service import TimerServices
from ..store.timers import RaceTimers, Timer, TimerStore

_NAMES = ("hedge", "cutover", "safety")


def _serve(
    url: str,
    prefix: str,
    namespace: str,
    path: str,
    lease_ms: int,
    stop: str,
    hang: str,
    threads: int = 1,
    shards: int = 1,
) -> None:
    """A firing process: fire until told to stop, then append its CPU seconds.

    Once the ``hang`` file exists its handler hangs (a line ``hung`` marks it), so the process
    can be killed while it holds claimed timers, the worst moment for a claimer to die.
    """
    import redis

    client = redis.Redis.from_url(url, decode_responses=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def handler(timer: Timer) -> None:
        fired = time.time() * 1000
        if hang and os.path.exists(hang):
            os.write(fd, b"hung\n")
            time.sleep(3600)
        os.write(fd, f"{timer.id} {timer.due_ms} {fired:.3f} {timer.deliveries}\n".encode())

    timers = RaceTimers(client, RaceShards(prefix, namespace, shards))
    service = TimerServices(timers, handler, lease_ms=lease_ms, threads=threads)
    service.start()
    # A stop file, not a multiprocessing.Event: Event.set() blocks forever once a process
    # that was waiting on it has been SIGKILLed (its condition waits for every sleeper).
    while not os.path.exists(stop):
        time.sleep(0.05)
    service.stop()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    os.write(fd, f"cpu {usage.ru_utime + usage.ru_stime:.3f}\n".encode())
    os.close(fd)


def _redis_cpu_s(client: Any) -> float:
    with translate_errors():
        info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _bytes_per_timer(client: Any, timers: RaceTimers) -> float | None:
    """Redis memory of the due ZSETs and the record hashes, per waiting timer (all elements)."""
    keys = [k for store in timers.stores for k in (store.keys.due, store.keys.data)]
    with translate_errors():
        waiting = timers.pending()
        if not waiting:
            return None
        used = sum(client.memory_usage(key, samples=0) or 0 for key in keys)
    return round(used / waiting, 1)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(q * len(ordered) + 0.5)) - 1))
    return ordered[rank]


def _schedule(n: int, window_s: float, rng: random.Random, t0: float) -> list[tuple]:
    """(arm_at_ms, key, due_ms) for ``n`` timers, sorted by when they are armed."""
    plan = []
    for i in range(n):
        due = t0 + 1000 + rng.uniform(0, window_s * 1000)
        arm_at = max(t0, due - rng.uniform(50, 10_000))
        plan.append((arm_at, f"race{i // 3}|{_NAMES[i % 3]}", int(due)))
    plan.sort()
    return plan


def run_row(
    url: str,
    prefix: str,
    n: int,
    processes: int,
    window_s: float,
    lease_ms: int,
    kill: bool,
    threads: int = 1,
    shards: int = 1,
) -> dict[str, Any]:
    """Run one row of the benchmark and return its measured figures."""
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    client = client_for(url)
    timers = RaceTimers(client, RaceShards(prefix, namespace, shards))
    workdir = Path(tempfile.mkdtemp(prefix="gpuhedge-bench-timers-"))
    ctx = multiprocessing.get_context("fork")
    stop = str(workdir / "stop")
    hang = str(workdir / "hang")
    paths = [workdir / f"p{i}.log" for i in range(processes)]
    procs = [
        ctx.Process(
            target=_serve,
            args=(
                url,
                prefix,
                namespace,
                str(p),
                lease_ms,
                stop,
                hang if i == 0 else "",
                threads,
                shards,
            ),
        )
        for i, p in enumerate(paths)
    ]
    for p in procs:
        p.start()
    cpu_before, wall_before = _redis_cpu_s(client), time.monotonic()
    try:
        t0 = time.time() * 1000 + 300
        plan = _schedule(n, window_s, random.Random(n * 31 + processes), t0)
        kill_at = t0 + 1000 + window_s * 500
        i = 0
        pending_peak = 0
        bytes_per_timer = None
        killed = 0  # set once the victim, hung in its handler holding claims, is SIGKILLed

        def kill_if_hung() -> int:
            if not kill or time.time() * 1000 < kill_at:
                return 0
            Path(hang).touch()
            if not (procs[0].is_alive() and paths[0].exists()):
                return 0
            if b"hung" not in paths[0].read_bytes():
                return 0
            os.kill(cast(int, procs[0].pid), signal.SIGKILL)  # started
            procs[0].join(5)
            return 1

        next_sample = 0.0
        while i < len(plan):
            now = time.time() * 1000
            batches: dict[TimerStore, list[tuple[str, int, dict[str, Any]]]] = {}
            while i < len(plan) and plan[i][0] <= now:
                race = plan[i][1].split("|")[0]
                batches.setdefault(timers.of(race), []).append(
                    (plan[i][1], plan[i][2], {"race": race})
                )
                i += 1
            for store, armed in batches.items():  # each shard's in one round trip, on its slot
                store.arm_many(armed)
            if batches and bytes_per_timer is None:  # after the first (largest) batch
                bytes_per_timer = _bytes_per_timer(client, timers)
            if now >= next_sample:
                pending_peak = max(pending_peak, timers.pending())
                next_sample = now + 100
            killed = killed or kill_if_hung()
            time.sleep(0.002)
        # Wait for the last due time, plus a lease for timers a killed process held.
        deadline = time.monotonic() + (plan[-1][2] - time.time() * 1000) / 1000 + 1.0
        if kill:
            deadline += lease_ms / 1000 + 5
        while time.monotonic() < deadline and (timers.pending() or timers.in_flight()):
            killed = killed or kill_if_hung()
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        redis_cpu = _redis_cpu_s(client) - cpu_before
        wall = time.monotonic() - wall_before
        Path(stop).touch()
        for p in procs:
            p.join(10)
            if p.is_alive():
                os.kill(cast(int, p.pid), signal.SIGKILL)  # started
                p.join(5)
    first: dict[str, tuple[float, float, int]] = {}  # id -> (fired, lag, deliveries)
    firings = 0
    cpu = 0.0
    by_process = []
    for path in paths:
        before = firings
        for line in path.read_text().splitlines() if path.exists() else []:
            parts = line.split(" ")
            if parts[0] == "hung":
                continue
            if parts[0] == "cpu":
                cpu += float(parts[1])
                continue
            firings += 1
            timer_id, due, fired, deliveries = parts[0], int(parts[1]), float(parts[2]), parts[3]
            if timer_id not in first or fired < first[timer_id][0]:
                first[timer_id] = (fired, fired - due, int(deliveries))
        by_process.append(firings - before)
    shutil.rmtree(workdir, ignore_errors=True)
    with translate_errors(url):
        for store in timers.stores:  # one slot each: one delete per shard
            k = store.keys
            client.delete(k.due, k.inflight, k.data, k.deliveries, k.seq, k.chains)
    lags = [lag for _, lag, _ in first.values()]
    plain = [lag for _, lag, d in first.values() if d == 1]
    return {
        "timers": n,
        "races": (n + 2) // 3,
        "processes": processes,
        "threads": threads,
        "shards": shards,
        "window_s": window_s,
        "lease_ms": lease_ms,
        "killed": killed,
        "fired": len(first),
        "lost": n - len(first),
        "duplicates": firings - len(first),
        "fired_by_process": by_process,  # how the firing spread (the killed process first)
        "pending_peak": pending_peak,
        "redis_bytes_per_waiting_timer": bytes_per_timer,
        "redelivered": sum(1 for _, _, d in first.values() if d > 1),
        "lag_p50_ms": round(_percentile(lags, 0.50), 2),
        "lag_p99_ms": round(_percentile(lags, 0.99), 2),
        "lag_max_ms": round(max(lags, default=float("nan")), 2),
        "lag_p99_ms_first_delivery": round(_percentile(plain, 0.99), 2),
        "cpu_s_surviving_processes": round(cpu, 2),
        # Server-wide: includes any other client of this Redis during the row.
        "redis_cpu_pct": round(100 * redis_cpu / wall, 1),
        "row_wall_s": round(wall, 1),
    }


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--timers", "n", type=click.IntRange(3), default=None, help="Timers per row.")
@click.option(
    "--concurrency", type=click.IntRange(1, 32), default=2, help="Firing processes per row."
)
@click.option("--window", type=click.FloatRange(0.5), default=10.0, help="Seconds of due times.")
@click.option("--lease-ms", type=click.IntRange(100), default=2000, help="Claim lease (ms).")
@click.option(
    "--threads",
    type=click.IntRange(1, 256),
    default=1,
    help="Handler threads per firing process (TimerService threads).",
)
@click.option(
    "--shards",
    type=click.IntRange(1, MAX_SHARDS),
    default=1,
    help="Race shards the timers are spread over (dealt over the firing processes).",
)
def command(
    as_json: bool,
    n: int | None,
    concurrency: int,
    window: float,
    lease_ms: int,
    threads: int,
    shards: int,
):
    """Firing lag p50/p99 of durable timers with many races, and with a claimer killed."""
    settings = click.get_current_context().find_root().obj.settings
    ping(settings.redis_url)
    survivors = max(concurrency, 2)  # the kill row needs someone left to fire
    rows = [(1000, 1, False), (6000, concurrency, False), (6000, survivors, True)]
    if n is not None:
        rows = [(n, concurrency, False), (n, survivors, True)]
    results = []
    for timers, processes, kill in rows:
        row = run_row(
            settings.redis_url,
            settings.prefix,
            timers,
            processes,
            window,
            lease_ms,
            kill,
            threads,
            shards,
        )
        results.append(row)
        if not as_json:
            click.echo(
                f"timers={row['timers']} processes={row['processes']} "
                f"threads={row['threads']} shards={row['shards']} killed={row['killed']}: "
                f"lag p50 {row['lag_p50_ms']} ms, p99 {row['lag_p99_ms']} ms, "
                f"max {row['lag_max_ms']} ms; fired {row['fired']}, lost {row['lost']}, "
                f"duplicates {row['duplicates']}, redelivered {row['redelivered']}"
            )
    if as_json:
        setup = {
            "concurrency": concurrency,
            "threads": threads,
            "shards": shards,
            "window_s": window,
            "lease_ms": lease_ms,
        }
        click.echo(json.dumps({"bench": "timers", "setup": setup, "results": results}, indent=2))
