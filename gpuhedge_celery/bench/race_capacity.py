"""The capacity row of ``bench races``: many races in flight at once, and what each costs.

``--races`` races start over a ramp with sim jobs of 5-30 provider seconds and a hedge timer
half-way. The row measures the peak number of races in flight, timer lag, CPU per race (the
workers, Redis and the bench client), memory per race in flight, and Redis traffic per race:

* ``round_trips_per_race``: requests the coordination workers sent to Redis (a pipeline or a
  script is one), counted client-side in each worker (:mod:`.redis_probe`): every request
  through redis-py, so Celery's broker polls, result writes and task events too;
* ``coordination_round_trips_per_race``: the same less ``sim_provider_round_trips_per_race``,
  the simulated providers' own ledger reads and writes (the sim stands in for a provider's
  HTTP API by keeping its jobs in the same Redis; a real provider adds none of these);
* ``redis_bytes_per_race``: Redis's ``total_net_input_bytes`` over the row / races (every
  client: the workers and this bench client, whose own share is ``redis_bytes_per_race_by``);
* ``payload_bytes``: the size of one winning payload as JSON, to compare with the above;
* ``redis_commands_per_race``: Redis's ``total_commands_processed`` over the row / races.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from redis.crc import key_slot

from . import redis_probe
from ._procs import cpu_s as _cpu_s
from ._procs import rss_bytes as _rss_bytes

Bench = Any  # bench/races.py's Bench (which imports this module)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q / 100.0 * len(ordered)))], 3)


def started_peak(receipts: list[dict[str, Any]]) -> int:
    """The most races at once that had started (the race created) and not yet finished, from
    their receipts: unlike the sent-and-unfinished peak, it leaves out races whose messages
    still wait in the broker."""
    edges = []
    for receipt in receipts:
        start, end = receipt.get("created_at"), receipt.get("finished_at")
        if start is not None and end is not None:
            edges += [(start, 1), (end, -1)]
    peak = now = 0
    for _, step in sorted(edges):  # at a tie an end (-1) sorts first: not counted as overlap
        now += step
        peak = max(peak, now)
    return peak


TIMER_LAG_P99_MS = 50.0  # the capacity target: hedges fire this close to their due time
INTAKE_LAG_P99_MS = 100.0  # and the races counted had started, not waited in the broker


def meets_capacity_target(row: dict[str, Any]) -> bool:
    """Timer lag p99 within the target, with the races started promptly: a row whose races
    queue in the broker for seconds does not hold that many races in flight, whatever its
    timers do."""
    timers = row["timer_lag_ms"]["p99_ms"] or 0.0  # None: no race hedged
    intake = row["intake_lag_ms"]["p99_ms"]  # None: no race finished
    return timers <= TIMER_LAG_P99_MS and intake is not None and intake <= INTAKE_LAG_P99_MS


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50_ms": _pct(values, 50),
        "p99_ms": _pct(values, 99),
        "max_ms": round(max(values), 3) if values else None,
        "mean_ms": round(statistics.fmean(values), 3) if values else None,
    }


def payload_bytes(bench: Bench, provider: str) -> int:
    """JSON bytes of the payload a completed sim job of ``provider`` returns (its WAV)."""
    from ..providers.sim import _audio_b64
    from ..store import codec

    spec = bench.config.build(provider).spec
    return codec.size(_audio_b64(spec.audio_s, spec.sample_rate, False))


def cpu_snapshot(bench: Bench) -> dict[str, float]:
    """CPU seconds used so far by the workers, Redis and this client (a row's cost is the
    difference of two)."""
    return {
        "workers": sum(_cpu_s(p) for p in bench.worker_pids()),
        "redis": bench.redis_cpu_s(),
        "client": time.process_time(),
    }


def still_missing(client: Any, names: set[Any], key_of: Callable[[Any], Any]) -> set[Any]:
    """The ``names`` whose key (``key_of(name)``) Redis does not hold yet, one pipelined round
    trip per slot (a cluster's pipelines keep to one): how a row finds its races (receipts) or
    tasks (results) done."""
    by_slot: dict[int, list[Any]] = {}
    for name in names:
        by_slot.setdefault(key_slot(str(key_of(name)).encode()), []).append(name)
    missing: set[Any] = set()
    for batch in by_slot.values():
        pipe = client.pipeline(transaction=False)
        for name in batch:
            pipe.exists(key_of(name))
        missing.update(n for n, done in zip(batch, pipe.execute(), strict=True) if not done)
    return missing


def _traffic(bench: Bench) -> dict[str, Any]:
    """Redis's input bytes and commands so far, the workers' and this client's requests."""
    workers = redis_probe.read_totals(bench.probe_dir)
    return {
        "net_input_bytes": int(bench.redis_info_sum("stats", "total_net_input_bytes")),
        "commands": int(bench.redis_info_sum("stats", "total_commands_processed")),
        "worker_round_trips": workers["round_trips"],
        "worker_bytes": workers["bytes"],
        "sim_round_trips": workers["sim_round_trips"],
        "sim_bytes": workers["sim_bytes"],
        "client_bytes": redis_probe.totals()["bytes"],
        "sites": workers["sites"],
        "site_bytes": workers["site_bytes"],
    }


def site_fields(before: dict[str, int], after: dict[str, int], races: int) -> dict[str, float]:
    """The workers' round trips (or bytes) per race by where they were sent from, most first
    (counted only with ``GPUHEDGE_BENCH_PROBE_SITES=on``, see :mod:`.redis_probe`)."""
    per_race = {k: (n - before.get(k, 0)) / races for k, n in after.items()}
    ranked = sorted(per_race.items(), key=lambda kv: -kv[1])
    return {k: round(v, 2) for k, v in ranked if v >= 0.05}


def traffic_fields(before: dict[str, Any], after: dict[str, Any], races: int) -> dict[str, Any]:
    """Per-race Redis traffic between two :func:`_traffic` snapshots."""
    d = {k: after[k] - before[k] for k in before if k not in ("sites", "site_bytes")}
    sites = site_fields(before.get("sites", {}), after.get("sites", {}), races)
    site_bytes = site_fields(before.get("site_bytes", {}), after.get("site_bytes", {}), races)
    return {
        **({"round_trips_by_site": sites} if sites else {}),
        **({"bytes_by_site": {k: round(v) for k, v in site_bytes.items()}} if sites else {}),
        "round_trips_per_race": round(d["worker_round_trips"] / races, 1),
        # the same without the simulated providers' ledger (a real provider answers over HTTP)
        "coordination_round_trips_per_race": round(
            (d["worker_round_trips"] - d["sim_round_trips"]) / races, 1
        ),
        "sim_provider_round_trips_per_race": round(d["sim_round_trips"] / races, 1),
        "redis_bytes_per_race": round(d["net_input_bytes"] / races),
        "redis_bytes_per_race_by": {
            "workers": round(d["worker_bytes"] / races),
            "sim_provider": round(d["sim_bytes"] / races),  # of the workers' bytes
            "client": round(d["client_bytes"] / races),
        },
        "redis_commands_per_race": round(d["commands"] / races, 1),
    }


def capacity_row(
    bench: Bench,
    races: int,
    scale: float,
    seed: int,
    ramp_s: float | None = None,
    provider: str = "sim",
) -> dict[str, Any]:
    """``races`` races in flight at once with 5-30 s jobs (scaled); lag, CPU and memory.

    ``provider``: ``sim`` (providers ``p`` -> ``h``) or ``runpod-fake`` (``rp`` -> ``rh`` on the
    RunPod fake, the same job times; the row then also reports the fake's request counts)."""
    runpod = provider == "runpod-fake"
    primary, hedge_name = ("rp", "rh") if runpod else ("p", "h")
    if runpod:
        from . import races_runpod

        bench.fake.reset()  # this row's counts only (no job of an earlier row is in flight)
        fake_cpu0 = bench.fake.stats()["cpu_s"]
    rng = random.Random(seed)
    hedge_after_s = 15.0 * scale  # provider second 15: races with a slow primary hedge
    if ramp_s is None:
        ramp_s = 15.0 * scale
    pings = []
    for _ in range(200):  # this machine's speed today, to compare runs on other days
        t0 = time.perf_counter()
        bench.client.ping()
        pings.append((time.perf_counter() - t0) * 1000.0)
    redis_probe.install()  # this client's own requests: its share of Redis's input bytes
    used0 = int(bench.redis_info_sum("memory", "used_memory"))
    nodes0 = bench.redis_cpu_by_node()
    rss0 = sum(_rss_bytes(p) for p in bench.worker_pids())
    from .races_runpod import receiver_cpu_s

    receiver0 = receiver_cpu_s(bench.receiver) if bench.receiver else 0.0
    traffic0 = _traffic(bench)
    cpu0 = cpu_snapshot(bench)
    t_start = time.perf_counter()
    ids: list[str] = []
    sent_at: list[float] = []
    ends: dict[tuple[str, str], float] = {}  # (race, role) -> queue + run, real seconds
    policy = f"hedge:{primary}->{hedge_name}@{hedge_after_s:.3f}s"
    for i in range(races):
        p_total = rng.uniform(5, 30)
        p_queue = rng.uniform(0, min(5, p_total - 5))
        h_total = rng.uniform(5, 10)
        if runpod:  # the fake runs in real time: the same fates, scaled here
            request = races_runpod.request(
                p_queue * scale, (p_total - p_queue) * scale, 0.5 * scale, (h_total - 0.5) * scale
            )
        else:
            request = {
                "sim": {
                    "p": {"queue_s": p_queue, "run_s": p_total - p_queue},
                    "h": {"queue_s": 0.5, "run_s": h_total - 0.5},
                }
            }
        sent_at.append(time.time())  # the race's own start is on the same host's clock
        ids.append(bench.send(request, policy=policy).id)
        ends[(ids[-1], "primary")] = p_total * scale
        ends[(ids[-1], "hedge")] = h_total * scale
        due = t_start + ramp_s * (i + 1) / races
        pause = due - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    # In flight = started and without a receipt yet (the heartbeat index can also hold
    # finished races that linger there, so it is not counted).
    peak, peak_used, peak_rss = 0, used0, rss0
    deadline = time.monotonic() + 30.0 * scale + 120
    pending = set(ids)
    while pending and time.monotonic() < deadline:
        pending = still_missing(
            bench.client, pending, lambda race_id: bench.store.shards.race(race_id).receipt
        )
        if len(pending) > peak:
            peak = len(pending)
            peak_used = int(bench.redis_info_sum("memory", "used_memory"))
            peak_rss = sum(_rss_bytes(p) for p in bench.worker_pids())
        time.sleep(0.5)  # each look costs the client and Redis one EXISTS per race
    wall = time.perf_counter() - t_start
    time.sleep(2 * redis_probe.WRITE_INTERVAL_S)  # the workers' counts up to now, written
    traffic = traffic_fields(traffic0, _traffic(bench), races)
    parts = {k: v - cpu0[k] for k, v in cpu_snapshot(bench).items()}
    by_node = [b - a for a, b in zip(nodes0, bench.redis_cpu_by_node(), strict=True)]
    if bench.receiver is not None:
        parts["receiver"] = receiver_cpu_s(bench.receiver) - receiver0
    cpu = sum(parts.values())
    hedge_lag, watch_lag, intake_lag, hedged, won = [], [], [], 0, 0
    receipts = []
    for race_id, sent in zip(ids, sent_at, strict=True):
        receipt = bench.store.receipt(race_id)
        if receipt is None:
            continue
        receipts.append(receipt)
        if receipt.get("created_at") is not None:
            intake_lag.append((receipt["created_at"] - sent) * 1000.0)
        won += receipt.get("winner") is not None
        by_role = {a["role"]: a for a in receipt["attempts"]}
        first, second = by_role.get("primary"), by_role.get("hedge")
        if first and second and first.get("submitted_at_s") is not None:
            hedged += 1
            due = first["submitted_at_s"] + hedge_after_s
            hedge_lag.append((second["launched_at_s"] - due) * 1000.0)
        for a in receipt["attempts"]:
            job_s = ends.get((race_id, a.get("role")))
            if a.get("state") == "COMPLETED" and a.get("result_at_s") is not None and job_s:
                watch_lag.append((a["result_at_s"] - a["submitted_at_s"] - job_s) * 1000.0)
    row = {
        "row": "capacity",
        "provider": provider,
        "leaks": sum(len(r.get("leaks") or []) for r in receipts),
        "races": races,
        "concurrent_peak": peak,
        "started_peak": started_peak(receipts),
        "finished": races - len(pending),
        "won": won,
        "hedged": hedged,
        "job_s": [5 * scale, 30 * scale],
        "time_scale": scale,
        "timer_lag_ms": _summary(hedge_lag),
        "watch_lag_ms": _summary(watch_lag),
        "intake_lag_ms": _summary(intake_lag),
        "ramp_s": ramp_s,
        "wall_s": round(wall, 2),
        "cpu_ms_per_race": round(1000.0 * cpu / races, 1),
        "cpu_ms_per_race_by": {k: round(1000.0 * v / races, 1) for k, v in parts.items()},
        "cpu_pct": round(100.0 * cpu / wall / (os.cpu_count() or 1), 1),
        "cpus": os.cpu_count(),
        "redis_ping_p50_ms": round(statistics.median(pings), 3),
        "redis_nodes": len(by_node),
        "redis_cpu_ms_per_race_by_node": [round(1000.0 * c / races, 3) for c in by_node],
        "redis_busiest_node_share": round(max(by_node) / sum(by_node), 3) if sum(by_node) else None,
        "redis_memory_bytes_per_race": round((peak_used - used0) / max(peak, 1)),
        **traffic,
        "payload_bytes": None if runpod else payload_bytes(bench, "p"),
        "worker_rss_bytes_per_race": round((peak_rss - rss0) / max(peak, 1)),
        "worker_rss_bytes": peak_rss,
        "what": "races started over a ramp; timer lag = hedge launch - its due time; "
        "intake lag = a race's start - its send; concurrent peak: sent, not finished; "
        "started peak: started, not finished; "
        "watch lag = a finished job seen - its end; memory: growth at the peak / races in flight; "
        "Redis traffic: see bench/race_capacity.py",
    }
    if runpod:
        row["runpod"] = races_runpod.report(
            bench.fake, fake_cpu0, receipts, bench.receiver is not None, bench.receiver_workers
        )
        with_fake = cpu + row["runpod"]["fake_cpu_s"]
        row["cpu_ms_per_race_with_fake"] = round(1000.0 * with_fake / races, 1)
    return row
