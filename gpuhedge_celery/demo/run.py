"""The demo's scenarios: hedged races on sim providers and a CPU-runner GPU pool, on Celery.

Everything here is simulated and named so: providers are the packaged ``sim`` adapters
(``gpuhedge_celery/data/demo.yaml``: ``time_scale`` 0.1, simulated time runs 10x faster than
the wall clock), GPUs are CPU runners that sleep, and by default Redis is an embedded fakeredis
server. The Celery workers, the race driver, the lease store and the receipts are the real ones.
On a real Redis (``--redis-url``) the demo deletes every key it wrote when it ends, except the
races' receipts, which expire after ``RECEIPT_TTL_S``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import envvars
from .. import settings as process_settings
from ..core.stats import misses, nearest_rank
from ..store.keys import all_keys
from .cleanup import RECEIPT_TTL_S, clean_up
from .workers import LocalWorkers

Echo = Callable[[str], None]

# (sim_key, policy, what the race shows); keys are documented in data/demo.yaml
SCENARIOS = [
    (0, "fixed", "fast path: the cheap primary answers, no hedge"),
    (1, "fixed", "slow primary: the hedge launched at 10 s wins, the primary is cancelled"),
    (2, "fixed", "malformed result: the validator rejects the primary's silent WAV"),
    (3, "state_aware", "queued cutover: still QUEUED at 2.5 s, cancelled for $0"),
    (4, "cascade", "cascade: the hedge is queued too, the reserve is launched at 25 s"),
]
POLICIES = ["single", "fixed", "state_aware", "cascade"]
POOL_GPUS = 2
# Keys 0-4 are the hand-picked scenarios (mostly slow paths); the batch draws from key 5 on, where
# the sim's fates follow its configured rates.
BATCH_FIRST_KEY = 5


@dataclass
class DemoReport:
    """What the demo measured, for ``--json`` and the tests."""

    redis: str
    prefix: str = ""
    scenarios: list[dict[str, Any]] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    pool: list[dict[str, Any]] = field(default_factory=list)
    pool_races: list[dict[str, Any]] = field(default_factory=list)
    records_report: list[dict[str, Any]] = field(default_factory=list)  # `report` by policy
    cleanup: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0


def demo_env(redis_url: str, prefix: str) -> dict[str, str]:
    """The environment every demo process runs with (packaged demo config, quick timers).
    A store on a Redis Cluster keeps the broker and race shards the caller's environment
    names: Celery needs a Redis of its own there, and every process the same shard count."""
    from ..config import packaged_path
    from ..redis_url import is_cluster

    keep = (envvars.BROKER_URL_VAR, envvars.RACE_SHARDS_VAR) if is_cluster(redis_url) else ()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUHEDGE_") or k in keep}
    env.update(
        {
            "GPUHEDGE_REDIS_URL": redis_url,
            "GPUHEDGE_PREFIX": prefix,
            "GPUHEDGE_BROKER_PREFIX": f"{prefix}:",
            "GPUHEDGE_CONFIG": str(packaged_path("demo.yaml")),
            "GPUHEDGE_HOST": "demo-host",
            "GPUHEDGE_WATCH_INTERVAL_S": "0.05",
            "GPUHEDGE_COORD_CONCURRENCY": "16",
            "GPUHEDGE_RECEIPT_TTL_S": str(RECEIPT_TTL_S),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


class RaceWatcher:
    """Prints each race's moments (launches, cutovers, cancels, the winner) as they happen."""

    def __init__(self, store: Any, echo: Echo, time_scale: float):
        self.store = store
        self.echo = echo
        self.scale = time_scale
        self.seen: dict[str, set[str]] = {}

    def poll(self, races: dict[str, str]) -> bool:
        """Print new moments of ``races`` (race id -> label); True when all have finished."""
        done = True
        fresh: list[tuple[float, str]] = []
        for race_id, label in races.items():
            record = self.store.load(race_id)
            if record is None:
                done = False
                continue
            race = record.state.get("race", {})
            seen = self.seen.setdefault(race_id, set())
            for moment, t in _moments(race):
                if moment not in seen:
                    seen.add(moment)
                    fresh.append((t, f"{label:<8} {moment}"))
            done = done and bool(race.get("finished"))
        # at equal times the winner line comes last (after the result that made it win)
        for t, line in sorted(fresh, key=lambda f: (f[0], "WINNER" in f[1])):
            self.echo(f"  {t / self.scale:6.1f} s  {line}")
        return done


def final_receipt(store: Any, race_id: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The race's receipt once written (losers cleaned up), else its provisional one."""
    from ..race.receipt import read_receipt

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = store.receipt(race_id)
        if found is not None:
            return found
        time.sleep(0.05)
    return read_receipt(store, race_id) or {}


def _moments(race: dict[str, Any]) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    for a in race.get("attempts", []):
        who = f"{a['role']} {a['provider']}"
        out.append((f"{who} launched", a["launched_at"]))
        for t, label in a.get("timeline", []):
            if label not in ("launched", "submitted"):
                out.append((f"{who}: {label}", t))
    if race.get("winner"):
        a = next(x for x in race["attempts"] if x["id"] == race["winner"])
        out.append((f"WINNER {a['provider']} ({a['role']})", a.get("result_at") or 0.0))
    return sorted(out, key=lambda m: m[1])


def run_demo(
    redis_url: str,
    *,
    embedded: bool,
    races: int,
    pool_jobs: int,
    echo: Echo,
    plot_dir: str | None = None,
) -> DemoReport:
    """Start workers, run the scenarios, the policy batch and the pool; return the figures."""
    t0 = time.monotonic()
    prefix = f"demo{os.getpid()}"
    env = demo_env(redis_url, prefix)
    os.environ.update({k: v for k, v in env.items() if k.startswith("GPUHEDGE_")})
    process_settings.reload()  # this process's tasks run with the demo's settings too
    workers = LocalWorkers(env)
    from ..settings import redact_url

    kind = "embedded fakeredis (simulated Redis)" if embedded else redact_url(redis_url)
    report = DemoReport(redis=kind, prefix=prefix)
    echo(f"Redis: {kind}; key prefix {prefix}")
    echo(
        "Starting Celery workers: 1 coordinator (races, attempts, pool waiters) and "
        f"{POOL_GPUS} GPU workers (CPU runners standing in for GPUs)..."
    )
    workers.start("coord")
    for i in range(POOL_GPUS):
        workers.start(
            f"gpu{i}", GPUHEDGE_GPU=str(i), GPUHEDGE_POOL="demo", GPUHEDGE_RUNNER="cpu:fixed=0.4"
        )
    try:
        from ..config import load_config
        from ..store.connection import client_for
        from ..store.races import RaceStore
        from ..tasks.races import hedged_infer

        cfg = load_config(process_settings.current().core.config_path)
        shards = process_settings.current().race_shards(prefix, redis_url)
        store = RaceStore(client_for(redis_url), shards)
        workers.wait_ready()
        echo(f"workers ready after {time.monotonic() - t0:.1f} s\n")
        _scenarios(hedged_infer, store, cfg.time_scale, echo, report)
        if embedded:
            echo(
                "  (the embedded Redis goes away when the demo ends: run it with --redis-url "
                "redis://... to keep the receipts for `gpuhedge-celery receipt`)\n"
            )
        else:
            echo(
                f"  read any receipt for the next {RECEIPT_TTL_S // 60} minutes with:\n"
                f"    gpuhedge-celery --redis-url {kind} --prefix {prefix} receipt "
                f"RACE_ID [--json]\n"
            )
        # The policy batch runs in the background while the pool sections play out.
        pending = _submit_batch(hedged_infer, races)
        _pool(redis_url, prefix, pool_jobs, echo, report)
        _pool_primary(hedged_infer, store, cfg.time_scale, echo, report)
        _batch_summary(pending, store, cfg, races, echo, report, embedded)
        from .records_report import records_report

        deadlines = list(cfg.slo_deadlines_s) or [60.0]
        report.records_report = records_report(
            redis_url, prefix, cfg.time_scale, deadlines, echo, plot_dir
        )
    finally:
        workers.stop()
        if not embedded:
            celery_redis = process_settings.current().glue.results_url
            report.cleanup = clean_up(redis_url, prefix, celery_redis)
            echo(
                f"removed the demo's {report.cleanup['deleted']} keys under "
                f"{all_keys(prefix)}; its {report.cleanup['receipts_kept']} receipts expire within "
                f"{RECEIPT_TTL_S // 60} minutes"
            )
    report.wall_s = time.monotonic() - t0
    return report


def _scenarios(hedged_infer: Any, store: Any, scale: float, echo: Echo, report: DemoReport) -> None:
    echo(
        "== 1. Five races, one per scenario (times are simulated provider seconds: "
        f"time_scale {scale:g}, simulated time runs {1 / scale:g}x faster than the wall clock) =="
    )
    for key, policy, what in SCENARIOS:
        echo(f"  race {key}: {policy:<12} {what}")
    echo("")
    started = {}
    for key, policy, _ in SCENARIOS:
        res = hedged_infer.apply_async(
            ({"sim_key": key, "text": f"demo {key}"},), {"policy": policy}
        )
        started[res.id] = (f"race {key}", res, key, policy)
    watcher = RaceWatcher(store, echo, scale)
    deadline = time.monotonic() + 20
    while not watcher.poll({rid: v[0] for rid, v in started.items()}):
        if time.monotonic() > deadline:
            echo("  (some races did not finish within 20 s)")
            break
        time.sleep(0.05)
    for race_id, (_label, _res, key, policy) in started.items():
        receipt = final_receipt(store, race_id)
        report.scenarios.append(
            {
                "race_id": race_id,
                "sim_key": key,
                "policy": policy,
                "winner": receipt.get("winner_provider"),
                "hedged": receipt.get("hedged"),
                "cut_over": receipt.get("cut_over"),
                "escalated": receipt.get("escalated"),
                "leaked": receipt.get("leaked"),
                "wasted_usd": receipt.get("wasted_usd"),
            }
        )
    last = list(started)[-1]
    echo(f"\nEvery race leaves an audited receipt. The cascade race's (race id {last}):")
    from ..commands.receipt import render

    receipt = final_receipt(store, last)
    if receipt:
        echo("  " + render(receipt).replace("\n", "\n  "))


def _submit_batch(hedged_infer: Any, races: int) -> list[tuple[str, Any]]:
    """Send ``races`` requests per policy, all at once; the summary collects them later."""
    pending = []
    for policy in POLICIES:
        for key in range(BATCH_FIRST_KEY, BATCH_FIRST_KEY + races):
            res = hedged_infer.apply_async(({"sim_key": key},), {"policy": policy})
            pending.append((policy, res))
    return pending


def _batch_summary(
    pending: list[tuple[str, Any]],
    store: Any,
    cfg: Any,
    races: int,
    echo: Echo,
    report: DemoReport,
    embedded: bool,
) -> None:
    from ..errors import RaceFailed

    scale = cfg.time_scale
    deadlines = list(cfg.slo_deadlines_s) or [60.0]
    echo(
        f"== 4. {races} requests x {len(POLICIES)} policies, all in flight at once "
        "(sent before section 2) =="
    )
    for _, res in pending:
        try:
            res.get(timeout=30, propagate=True)
        except RaceFailed:
            pass
        except Exception as e:  # a timeout here is a demo failure worth showing, not hiding
            echo(f"  race {res.id} did not finish: {type(e).__name__}: {e}")
    time.sleep(0.3)  # let losers' cancellations confirm so receipts are final
    header = (
        f"  {'policy':<12} {'p50 s':>7} {'p95 s':>7} "
        + " ".join(f"{f'miss>{d:g}s':>10}" for d in deadlines)
        + f" {'hedged':>7} {'$/req':>8} {'leaks':>6}"
    )
    echo(header)
    for policy in POLICIES:
        lat, active, hedged, leaks = [], [], 0, 0
        for p, res in pending:
            if p != policy:
                continue
            r = final_receipt(store, res.id)
            ms = r.get("latency_ms") if r.get("winner") else None
            lat.append(float("inf") if ms is None else ms / 1000.0 / scale)
            active.append(float(r.get("active_usd") or 0.0))
            hedged += bool(r.get("hedged"))
            leaks += bool(r.get("leaked"))
        row: dict[str, Any] = {
            "policy": policy,
            "n": len(lat),
            "p50_s": nearest_rank(lat, 0.5),
            "p95_s": nearest_rank(lat, 0.95),
            "misses": {str(d): misses(lat, d) for d in deadlines},
            "hedged": hedged,
            "active_usd": sum(active) / max(1, len(active)),
            "leaks": leaks,
        }
        report.summary.append(row)
        echo(
            f"  {policy:<12} {row['p50_s']:>7.1f} {row['p95_s']:>7.1f} "
            + " ".join(f"{row['misses'][str(d)]:>10}" for d in deadlines)
            + f" {hedged:>7} {row['active_usd']:>8.4f} {leaks:>6}"
        )
    echo(
        "  (simulated providers; latency in simulated provider seconds; $ = active compute at "
        "config rates)"
    )
    if embedded:
        echo(
            "  (on the embedded fakeredis each race step is slower than on a real Redis, which "
            "inflates p50;\n   run with --redis-url redis://... for representative latencies)"
        )
    echo("")


def _pool(redis_url: str, prefix: str, jobs: int, echo: Echo, report: DemoReport) -> None:
    from ..commands.leases import COLUMNS, lease_table
    from ..store.connection import client_for
    from ..store.leases import LeaseStore
    from ..tasks.pool import pooled_infer

    echo(
        f"== 2. GPU pool: {jobs} jobs of 0.4 s on {POOL_GPUS} GPUs, one job per GPU at a time "
        "(real seconds: the CPU runners are not simulated time) =="
    )
    leases = LeaseStore(client_for(redis_url), prefix)
    t0 = time.time()
    results = [pooled_infer.apply_async(({"job": i},), {"pool": "demo"}) for i in range(jobs)]
    rows = leases.table("demo")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(r.state == "held" for r in rows):
        time.sleep(0.02)  # show the table once both GPUs are busy
        rows = leases.table("demo")
    echo("  lease table while jobs run (gpuhedge-celery leases):")
    for line in lease_table(rows, time.time(), COLUMNS[:6]):
        echo(f"    {line}")
    for i, res in enumerate(results):
        out = res.get(timeout=60)
        started = float(out.get("started_at") or 0.0) - t0
        report.pool.append(
            {
                "job": i,
                "gpu": out["gpu_id"],
                "token": out["token"],
                "started_s": started,
                "run_s": out.get("run_s"),
            }
        )
        echo(f"  job {i}: GPU {out['gpu_id']} token {out['token']:<3} started at +{started:.2f} s")
    echo("  each GPU took the next job the moment its lease was released (keyspace event).\n")


def _pool_primary(
    hedged_infer: Any, store: Any, scale: float, echo: Echo, report: DemoReport
) -> None:
    from ..tasks.pool import pooled_infer

    echo(
        "== 3. The GPU pool as a race's primary, bursting to a serverless sim when saturated "
        f"(simulated seconds again: a 0.4 s GPU job shows as {0.4 / scale:g} s) =="
    )
    # The CPU runner echoes its request, so these races validate with `nonempty`, not `wav`.
    request = {"sim_key": 3, "duration_s": 0.4}
    kwargs = {"policy": "state_aware", "providers": ["gpu-pool", "sim-steady"]}
    kwargs["validator"] = "nonempty"
    cases = [("free", "GPUs free: the pool's attempt gets a GPU at once")]
    cases.append(("saturated", "both GPUs busy: still QUEUED at the 2.5 s cutover -> burst"))
    for case, what in cases:
        blockers = []
        if case == "saturated":
            blockers = [
                pooled_infer.apply_async(({"duration_s": 3.0},), {"pool": "demo"})
                for _ in range(POOL_GPUS)
            ]
            time.sleep(0.3)  # let both blockers take their GPUs
        echo(f"  {case}: {what}")
        res = hedged_infer.apply_async((request,), kwargs)
        watcher = RaceWatcher(store, echo, scale)
        deadline = time.monotonic() + 20
        while not watcher.poll({res.id: case}) and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            res.get(timeout=30)  # the winner is known (or RaceFailed) before the receipt
        except Exception as e:
            echo(f"  race {res.id} failed: {type(e).__name__}: {e}")
        receipt = final_receipt(store, res.id)
        report.pool_races.append(
            {
                "case": case,
                "race_id": res.id,
                "winner": receipt.get("winner_provider"),
                "cut_over": receipt.get("cut_over"),
                "hedged": receipt.get("hedged"),
                "leaked": receipt.get("leaked"),
                "wasted_usd": receipt.get("wasted_usd"),
            }
        )
        for b in blockers:
            b.get(timeout=30)
    echo("")


def main_entry() -> None:  # pragma: no cover - convenience for `python -m`
    report = run_demo(sys.argv[1], embedded=False, races=10, pool_jobs=4, echo=print)
    print(report)
