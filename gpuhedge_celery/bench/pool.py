"""``gpuhedge-celery bench pool``: waiting time of GPU schedulers under Poisson load.

k simulated GPUs (time-compressed sleeps, lognormal job times) take the same Poisson arrivals
and the same job times under four schedulers:

``lease`` (ours)
    every request calls the real ``LeaseWaiter.acquire`` on the real Redis lease table (keyspace
    wake-ups, FIFO queue in Redis), holds the lease for its job time, then releases it.
``round_robin``
    request i goes to GPU i mod k and queues there (a balancer blind to busyness).
``least_connections``
    the GPU with the fewest outstanding requests in the balancer's view, a view refreshed from
    the truth only every ``--stale-s`` (real seconds, compressed like the jobs) and otherwise
    counting its own dispatches: what a web balancer sees of GPUs that hold no connection
    while they compute.
``ideal``
    a central FIFO queue with zero dispatch delay, computed on the same arrivals and job times.

The harness is threads in one process, not Celery workers (2 cores cannot host k + 1 worker
processes without measuring their contention instead): one thread per request for ``lease``.
The two balancers involve no Redis and no waiting logic of ours, so by default they are computed
by event simulation on the same arrivals and job times (``mode: computed``);
``--real-balancers`` runs them on threads (one per GPU draining a local FIFO) in real time.
Each result row says which (``mode``), and the JSON describes the harness.

Time compression matters: every millisecond of handoff stretches the effective job time, and at
rho 0.9 a 1 % longer job means ~10 % longer waits. Real GPU jobs last seconds, so the default
compressed mean job is 1 s (x10 for a 10 s job): compressed further, the same handoff is a larger
share of each job and ``lease`` drifts from ``ideal`` (docs/benchmarks.md).
``idle_while_waiting_s`` integrates min(idle GPUs, waiting requests) over the run: GPU time
wasted while work was queued.

With ``--runner SPEC`` (repeatable) the bench measures something else: the per-job overhead of
real GPU workers running each runner, beyond the model's own compute (``_pool_runners.py``).
"""

from __future__ import annotations

import heapq
import json
import math
import queue
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from ..store.keys import all_keys
from ._pool_runners import run_from_cli, runner_options

SCHEDULERS = ("lease", "round_robin", "least_connections", "ideal")
HARNESS = (
    "lease: one thread per request in one process calling LeaseWaiter.acquire on the real "
    "Redis lease table, holding the lease for the job time; no Celery worker processes"
)


@dataclass(frozen=True)
class Workload:
    """Arrival times (s from start) and job times (s) of one run; seeded, shared by schedulers."""

    arrivals: list[float]
    jobs: list[float]
    k: int
    rho: float
    mean_job_s: float

    @classmethod
    def generate(
        cls, *, k: int, rho: float, n: int, mean_job_s: float, sigma: float, seed: int
    ) -> Workload:
        rng = random.Random(seed)
        rate = rho * k / mean_job_s
        mu = math.log(mean_job_s) - sigma**2 / 2  # so the jobs' mean is mean_job_s
        t, arrivals = 0.0, []
        for _ in range(n):
            t += rng.expovariate(rate)
            arrivals.append(t)
        jobs = [rng.lognormvariate(mu, sigma) for _ in range(n)]
        return cls(arrivals, jobs, k, rho, mean_job_s)


@dataclass
class Record:
    """What happened to one request: when it arrived, started and ended, and where."""

    arrival: float
    start: float = math.nan
    end: float = math.nan
    gpu: int = -1


def ideal_fifo(work: Workload) -> list[Record]:
    """A central FIFO queue with k servers and zero dispatch delay (M/G/k)."""
    free = [0.0] * work.k
    records = []
    for arrival, job in zip(work.arrivals, work.jobs, strict=True):
        at = heapq.heappop(free)
        start = max(arrival, at)
        heapq.heappush(free, start + job)
        records.append(Record(arrival, start, start + job))
    return records


def idle_while_waiting(records: list[Record], k: int) -> float:
    """Integral over time of min(idle GPUs, waiting requests), in GPU-seconds."""
    events = []
    for r in records:
        events += [(r.arrival, 0, 1), (r.start, 1, -1), (r.start, 2, 1), (r.end, 3, -1)]
    events.sort()
    waiting = busy = 0
    total, last = 0.0, events[0][0] if events else 0.0
    for t, kind, delta in events:
        total += (t - last) * min(max(k - busy, 0), waiting)
        last = t
        if kind in (0, 1):
            waiting += delta
        else:
            busy += delta
    return total


def summarise(name: str, work: Workload, records: list[Record], mode: str) -> dict[str, object]:
    waits = sorted(r.start - r.arrival for r in records)
    p95 = waits[max(0, math.ceil(0.95 * len(waits)) - 1)]
    return {
        "scheduler": name,
        "rho": work.rho,
        "n": len(records),
        "mean_wait_s": round(statistics.fmean(waits), 4),
        "p95_wait_s": round(p95, 4),
        "idle_while_waiting_s": round(idle_while_waiting(records, work.k), 4),
        "mode": mode,
    }


def _pace(work: Workload, dispatch: Callable[[int, float], None]) -> float:
    """Call ``dispatch(i, arrival)`` at each arrival time; returns the run's time origin."""
    origin = time.monotonic() + 0.2
    for i, arrival in enumerate(work.arrivals):
        delay = origin + arrival - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        dispatch(i, origin)
    return origin


def run_lease(work: Workload, store, pool: str) -> list[Record]:
    """Every request waits in the real Redis lease table; the holder sleeps its job time."""
    from ..store.waiter import waiter_for

    waiter = waiter_for(store)
    records = [Record(a) for a in work.arrivals]
    threads = []
    errors: list[BaseException] = []

    def request(i: int, origin: float) -> None:
        try:
            lease = waiter.acquire(pool, f"bench-{i}")
            records[i].start = time.monotonic() - origin
            time.sleep(work.jobs[i])
            records[i].end = time.monotonic() - origin
            records[i].gpu = int(lease.gpu_id.rsplit(":", 1)[1])
            store.release(lease)
        except BaseException as e:  # noqa: BLE001 - reported after the run
            errors.append(e)

    def dispatch(i: int, origin: float) -> None:
        thread = threading.Thread(target=request, args=(i, origin), daemon=True)
        thread.start()
        threads.append(thread)

    _pace(work, dispatch)
    for thread in threads:
        thread.join()
    if errors:
        raise click.ClickException(f"lease run failed: {errors[0]}")
    return records


def run_balancer(
    work: Workload, choose: Callable[[int, list[int]], int], stale_s: float
) -> list[Record]:
    """A dispatcher in front of k busy-unaware GPUs, each draining its own FIFO queue."""
    records = [Record(a) for a in work.arrivals]
    queues: list[queue.Queue] = [queue.Queue() for _ in range(work.k)]
    outstanding = [0] * work.k  # the truth
    lock = threading.Lock()
    view: dict[str, Any] = {"counts": [0] * work.k, "at": -math.inf}

    def gpu(g: int, origin: float) -> None:
        while True:
            i = queues[g].get()
            if i is None:
                return
            records[i].start = time.monotonic() - origin
            time.sleep(work.jobs[i])
            records[i].end = time.monotonic() - origin
            records[i].gpu = g
            with lock:
                outstanding[g] -= 1

    origin_box: dict[str, float] = {}
    workers: list[threading.Thread] = []

    def dispatch(i: int, origin: float) -> None:
        if not workers:
            origin_box["t"] = origin
            for g in range(work.k):
                workers.append(threading.Thread(target=gpu, args=(g, origin), daemon=True))
                workers[-1].start()
        now = time.monotonic()
        with lock:
            if now - view["at"] >= stale_s:
                view["counts"], view["at"] = list(outstanding), now
            g = choose(i, view["counts"])
            view["counts"][g] += 1
            outstanding[g] += 1
        queues[g].put(i)

    _pace(work, dispatch)
    for q in queues:
        q.put(None)
    for w in workers:
        w.join()
    return records


def simulate_balancer(
    work: Workload, choose: Callable[[int, list[int]], int], stale_s: float
) -> list[Record]:
    """The same balancer as :func:`run_balancer`, computed on event time (no sleeping)."""
    free_at = [0.0] * work.k
    ends: list[list[float]] = [[] for _ in range(work.k)]
    view, view_at = [0] * work.k, -math.inf
    records = []
    for i, (arrival, job) in enumerate(zip(work.arrivals, work.jobs, strict=True)):
        if arrival - view_at >= stale_s:
            for g in range(work.k):
                ends[g] = [e for e in ends[g] if e > arrival]
            view, view_at = [len(e) for e in ends], arrival
        g = choose(i, view)
        view[g] += 1
        start = max(arrival, free_at[g])
        free_at[g] = start + job
        ends[g].append(start + job)
        records.append(Record(arrival, start, start + job, g))
    return records


def round_robin(i: int, _counts: list[int]) -> int:
    return i % len(_counts)


def least_connections(_i: int, counts: list[int]) -> int:
    return min(range(len(counts)), key=lambda g: (counts[g], g))


def _bench_store(settings, k: int):
    """A lease store under a throw-away prefix with k live GPUs in pool ``bench``."""
    from ..store.connection import client_for
    from ..store.leases import GpuInfo, LeaseStore
    from ..store.listener import enable_notifications

    client = client_for(settings.redis_url)
    enable_notifications(client)
    prefix = f"{settings.prefix}-benchpool-{uuid.uuid4().hex[:8]}"
    store = LeaseStore(client, prefix)
    store.set_pool_ttl("bench", 120_000)
    for g in range(k):
        store.register_gpu(GpuInfo(f"sim:{g}", "bench", "bench-host"))
    store.host_heartbeat("bench-host", 3_600_000)
    return store


def _drop(store) -> None:
    keys = list(store.client.scan_iter(all_keys(store.prefix), count=1000))
    for start in range(0, len(keys), 500):
        store.client.delete(*keys[start : start + 500])


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
@click.option("--rho", type=float, multiple=True, help="Load(s) to run (default 0.5 0.7 0.9).")
@click.option("--k", default=8, show_default=True, help="Simulated GPUs.")
@click.option("--requests", "n", default=400, show_default=True, help="Requests per load.")
@click.option("--mean-job-s", default=1.0, show_default=True, help="Compressed mean job time.")
@click.option("--sigma", default=1.0, show_default=True, help="Lognormal sigma of job times.")
@click.option(
    "--real-mean-job-s",
    default=10.0,
    show_default=True,
    help="The real GPU job mean the compressed jobs stand for.",
)
@click.option(
    "--stale-s",
    default=5.0,
    show_default=True,
    help="least_connections view refresh, in real (uncompressed) seconds.",
)
@click.option(
    "--real-balancers",
    is_flag=True,
    help="Run the two balancers on threads in real time instead of computing them.",
)
@click.option("--seed", default=1, show_default=True)
@runner_options
def command(
    as_json: bool,
    rho: tuple[float, ...],
    k: int,
    n: int,
    mean_job_s: float,
    sigma: float,
    real_mean_job_s: float,
    stale_s: float,
    real_balancers: bool,
    seed: int,
    runners: tuple[str, ...],
    jobs: int,
    warmup: int,
    request_json: str | None,
    server_cmd: str | None,
    dispatch: str,
) -> None:
    """Mean and p95 wait of lease / round_robin / least_connections / ideal scheduling; with
    --runner, the per-job overhead of GPU workers running real runners."""
    if runners:
        settings = click.get_current_context().find_root().obj.settings
        run_from_cli(settings, runners, jobs, warmup, request_json, server_cmd, as_json, dispatch)
        return
    loads = rho or (0.5, 0.7, 0.9)
    if k < 1 or n < 1 or mean_job_s <= 0 or sigma < 0 or real_mean_job_s <= 0:
        raise click.BadParameter("--k, --requests, --mean-job-s, --real-mean-job-s must be > 0")
    if any(not 0 < r < 1 for r in loads):
        raise click.BadParameter(f"--rho must be in (0, 1), got {loads}")
    settings = click.get_current_context().find_root().obj.settings
    compression = real_mean_job_s / mean_job_s
    store = _bench_store(settings, k)
    results = []
    try:
        for i, load in enumerate(loads):
            work = Workload.generate(
                k=k, rho=load, n=n, mean_job_s=mean_job_s, sigma=sigma, seed=seed + i
            )
            results.append(summarise("lease", work, run_lease(work, store, "bench"), "measured"))
            view_s = stale_s / compression
            for name, choose in (
                ("round_robin", round_robin),
                ("least_connections", least_connections),
            ):
                if real_balancers:
                    records, mode = run_balancer(work, choose, view_s), "measured"
                else:
                    records, mode = simulate_balancer(work, choose, view_s), "computed"
                results.append(summarise(name, work, records, mode))
            results.append(summarise("ideal", work, ideal_fifo(work), "computed"))
    finally:
        _drop(store)
    report = {
        "bench": "pool",
        "k": k,
        "requests_per_load": n,
        "mean_job_s": mean_job_s,
        "job_sigma": sigma,
        "compression": compression,
        "compression_note": f"1 s here stands for {compression:g} s of real GPU time",
        "least_connections_stale_s": stale_s,
        "harness": HARNESS,
        "seed": seed,
        "results": results,
    }
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"k={k} mean job {mean_job_s}s (x{compression:g} compression), n={n}/load")
    for r in results:
        click.echo(
            f"rho {r['rho']:.1f} {r['scheduler']:<18} mean {r['mean_wait_s']:>8.3f}s  "
            f"p95 {r['p95_wait_s']:>8.3f}s  idle-while-waiting "
            f"{r['idle_while_waiting_s']:>8.2f} GPU-s"
        )
