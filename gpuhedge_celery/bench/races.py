"""``gpuhedge-celery bench races``: a race's overhead, how many fit, how fast losers stop.

The benchmark starts its own real Celery workers (coordination role, threads pool) on a private
``redis-server`` when one is installed (else on ``--redis-url``, under a fresh key prefix that
is deleted afterwards) and sim providers from a generated config. Rows:

* ``overhead``: races with a zero-latency sim provider (``single`` policy), one at a time;
  end-to-end time at the client (``send_task`` to ``.get()`` returning) minus the winning
  provider's own latency, p50/p99; beside it, in the same run and alternating with it,
  ``celery-roundtrip``: a trivial task's ``.delay().get()`` on the same broker and workers.
* ``capacity``: ``--races`` races started within a short ramp, with sim jobs of 5-30 provider
  seconds (``--duration-s`` compresses them so the longest takes that many real seconds) and a
  hedge timer half-way; measures the peak number of races in flight, timer lag (the hedge
  timer's launch and the watch timer that sees a job finish, against their due times), CPU %
  of the whole machine (workers, Redis and this client), and Redis and worker memory per race.
* ``cancel``: races where the hedge wins while the primary still runs; time from the winner's
  validation (``won_at``) to the loser's native cancel call (recorded by the sim ledger).

Numbers are measured, never estimated; the JSON says what was run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

CONFIG = """
time_scale: {scale}
providers:
  p:
    role: primary
    adapter: sim
    billed_rate_per_s: 0.0003
    sim: {{seed: 1, slow_probability: 0, fast: {{queue_s: 0, run_s: 0}},
          cancel: {{ack_s: 0.05, terminal_s: 0.1}}}}
  h:
    role: hedge
    adapter: sim
    billed_rate_per_s: 0.0007
    sim: {{seed: 2, slow_probability: 0, fast: {{queue_s: 0, run_s: 0}},
          cancel: {{ack_s: 0.05, terminal_s: 0.1}}}}
policy:
  name: fixed
  params: {{hedge_after_ms: 10000}}
timeouts:
  attempt_cap_s: 120
validator: wav
"""


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q / 100.0 * len(ordered)))], 3)


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50_ms": _pct(values, 50),
        "p99_ms": _pct(values, 99),
        "max_ms": round(max(values), 3) if values else None,
        "mean_ms": round(statistics.fmean(values), 3) if values else None,
    }


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a live process has used, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Bench:
    """Workers, Redis and a client app for one benchmark run; :meth:`close` cleans up."""

    def __init__(self, redis_url: str | None, workers: int, concurrency: int, scale: float):
        self.tmp = Path(tempfile.mkdtemp(prefix="gpuhedge-bench-races-"))
        self.redis_proc: subprocess.Popen | None = None
        self.redis_url = redis_url or self._start_redis()
        self.prefix = f"bench{uuid.uuid4().hex[:8]}"
        config = self.tmp / "bench.yaml"
        config.write_text(CONFIG.format(scale=scale))
        self.env = {
            **os.environ,
            "GPUHEDGE_REDIS_URL": self.redis_url,
            "GPUHEDGE_PREFIX": self.prefix,
            "GPUHEDGE_BROKER_PREFIX": f"{self.prefix}:",
            "GPUHEDGE_CONFIG": str(config),
            "GPUHEDGE_COORD_CONCURRENCY": str(concurrency),
            "PYTHONUNBUFFERED": "1",
        }
        for name in ("GPUHEDGE_GPU", "CUDA_VISIBLE_DEVICES"):
            self.env.pop(name, None)
        self.workers: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        for i in range(workers):
            self._start_worker(i)
        self._wait_ready()
        import redis

        from ..config import load_config
        from ..providers.simledger import RedisLedger
        from ..store.races import RaceStore
        from ..tasks.app import create_app
        from ..tasks.config import GlueConfig

        self.app = create_app(GlueConfig.from_env(self.env))
        self.client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        self.store = RaceStore(self.client, self.prefix)
        self.ledger = RedisLedger(self.client, self.prefix)
        self.config = load_config(str(config))

    def _start_redis(self) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            raise click.UsageError("no redis-server installed: pass --redis-url")
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.redis_proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.tmp)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        url = f"redis://127.0.0.1:{port}/0"
        import redis

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis.Redis.from_url(url).ping()
                return url
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("the private redis-server did not start")

    def _start_worker(self, i: int) -> None:
        log = self.tmp / f"worker{i}.log"
        argv = [sys.executable, "-m", "celery", "-A", "gpuhedge_celery", "worker",
                "-n", f"bench{i}.{self.prefix}@localhost", "--loglevel", "WARNING",
                "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
        with open(log, "wb") as out:
            self.workers.append(
                subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                 cwd=str(self.tmp), start_new_session=True)
            )  # fmt: skip
        self.logs.append(log)

    def _wait_ready(self) -> None:
        from ..tasks.app import create_app
        from ..tasks.config import GlueConfig

        app = create_app(GlueConfig.from_env(self.env))
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.workers):
                raise RuntimeError("a bench worker exited:\n" + self.logs[0].read_text()[-2000:])
            replies = app.control.ping(timeout=0.5) or []
            if len(replies) >= len(self.workers):
                return
        raise RuntimeError("bench workers not ready in 90 s")

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers]

    def redis_cpu_s(self) -> float:
        info = self.client.info("cpu")
        return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

    def send(self, request: dict[str, Any], **kwargs: Any) -> Any:
        return self.app.send_task(
            "gpuhedge.hedged_infer", (request,), kwargs, queue="gpuhedge.coord"
        )

    def close(self) -> None:
        for p in self.workers:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
        try:
            if self.redis_proc is None:
                keys = list(self.client.scan_iter(f"{self.prefix}:*", count=1000))
                for i in range(0, len(keys), 1000):
                    self.client.delete(*keys[i : i + 1000])
        finally:
            if self.redis_proc is not None:
                self.redis_proc.kill()
                self.redis_proc.wait(10)
            shutil.rmtree(self.tmp, ignore_errors=True)


@contextmanager
def bench_cluster(
    redis_url: str | None, workers: int, concurrency: int, scale: float
) -> Iterator[Bench]:
    """A :class:`Bench` that is always cleaned up."""
    bench = Bench(redis_url, workers, concurrency, scale)
    try:
        yield bench
    finally:
        bench.close()


# ---------------------------------------------------------------------- rows
def overhead_rows(bench: Bench, n: int) -> list[dict[str, Any]]:
    """Zero-latency races one at a time, alternating with a trivial task's round trip."""
    zero = {"sim": {"p": {"queue_s": 0, "run_s": 0}}}
    for _ in range(20):  # warm both workers (imports, connections, config)
        bench.send(zero, policy="single", providers=["p"]).get(timeout=30)
        bench.app.send_task("celery.accumulate", (1,), queue="gpuhedge.coord").get(timeout=30)
    race_ms, coord_ms, trip_ms = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        result = bench.send(zero, policy="single", providers=["p"]).get(timeout=30)
        total = (time.perf_counter() - t0) * 1000.0
        race_ms.append(total - float(result.get("provider_ms") or 0.0))
        coord_ms.append(float(result["e2e_ms"]))
        t0 = time.perf_counter()
        bench.app.send_task("celery.accumulate", (1,), queue="gpuhedge.coord").get(timeout=30)
        trip_ms.append((time.perf_counter() - t0) * 1000.0)
    race = {"row": "overhead", **_summary(race_ms)}
    race["coordinator_e2e"] = _summary(coord_ms)
    race["what"] = "client send_task -> .get() minus the winner's provider_ms; zero-latency sim"
    trip = {"row": "celery-roundtrip", **_summary(trip_ms)}
    trip["what"] = "celery.accumulate .delay().get() on the same broker and workers"
    return [race, trip]


WARM_CANCELS = 10


def cancel_row(bench: Bench, n: int, scale: float) -> dict[str, Any]:
    """The hedge wins while the primary runs: winner's validation -> loser's cancel call."""
    # The primary would run 100 provider seconds; the hedge, launched at once, runs 50 ms of
    # real time. Races start 20 ms apart, so a few overlap as they would in service.
    request = {
        "sim": {"p": {"queue_s": 0, "run_s": 100}, "h": {"queue_s": 0, "run_s": 0.05 / scale}}
    }
    ids = []
    for _ in range(WARM_CANCELS + n):
        ids.append(bench.send(request, policy="hedge:p->h@0.001s").id)
        time.sleep(0.02)
    delays, warm = [], []
    for i, race_id in enumerate(ids):
        receipt = _wait_receipt(bench, race_id, 60 + 100 * scale)
        loser = next((a for a in receipt["attempts"] if a["id"] != receipt["winner"]), None)
        if loser is None or not loser.get("job_id") or receipt.get("won_at") is None:
            continue
        raw = bench.ledger.get(f"sim:cancel:{loser['provider']}:{loser['job_id']}")
        if raw:
            delay = (json.loads(raw)["sent"] - receipt["won_at"]) * 1000.0
            (warm if i < WARM_CANCELS else delays).append(round(delay, 3))
    row = {"row": "cancel", **_summary(delays), "races": n, "warm_up_ms": warm}
    row["what"] = (
        "winner's validation (won_at) -> the loser's native cancel call (sim ledger); "
        f"the first {WARM_CANCELS} races warm the workers' cancel threads and connections "
        "and are listed apart (warm_up_ms)"
    )
    return row


def _wait_receipt(bench: Bench, race_id: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = bench.store.receipt(race_id)
        if found is not None:
            return found
        time.sleep(0.05)
    raise RuntimeError(f"race {race_id} wrote no receipt in {timeout} s")


def capacity_row(
    bench: Bench, races: int, scale: float, seed: int, ramp_s: float | None = None
) -> dict[str, Any]:
    """``races`` races in flight at once with 5-30 s jobs (scaled); lag, CPU and memory."""
    rng = random.Random(seed)
    hedge_after_s = 15.0 * scale  # provider second 15: races with a slow primary hedge
    if ramp_s is None:
        ramp_s = 15.0 * scale
    pings = []
    for _ in range(200):  # this machine's speed today, to compare runs on other days
        t0 = time.perf_counter()
        bench.client.ping()
        pings.append((time.perf_counter() - t0) * 1000.0)
    used0 = int(bench.client.info("memory")["used_memory"])
    rss0 = sum(_rss_bytes(p) for p in bench.worker_pids())
    workers0, redis0 = sum(_cpu_s(p) for p in bench.worker_pids()), bench.redis_cpu_s()
    me0 = time.process_time()
    t_start = time.perf_counter()
    ids = []
    for i in range(races):
        p_total = rng.uniform(5, 30)
        p_queue = rng.uniform(0, min(5, p_total - 5))
        h_total = rng.uniform(5, 10)
        request = {"sim": {"p": {"queue_s": p_queue, "run_s": p_total - p_queue},
                           "h": {"queue_s": 0.5, "run_s": h_total - 0.5}}}  # fmt: skip
        ids.append(bench.send(request, policy=f"hedge:p->h@{hedge_after_s:.3f}s").id)
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
        pipe = bench.client.pipeline(transaction=False)
        batch = list(pending)
        for race_id in batch:
            pipe.exists(f"{bench.prefix}:race:{{{race_id}}}:receipt")
        for race_id, done in zip(batch, pipe.execute(), strict=True):
            if done:
                pending.discard(race_id)
        if len(pending) > peak:
            peak = len(pending)
            peak_used = int(bench.client.info("memory")["used_memory"])
            peak_rss = sum(_rss_bytes(p) for p in bench.worker_pids())
        time.sleep(0.5)  # each look costs the client and Redis one EXISTS per race
    wall = time.perf_counter() - t_start
    parts = {
        "workers": sum(_cpu_s(p) for p in bench.worker_pids()) - workers0,
        "redis": bench.redis_cpu_s() - redis0,
        "client": time.process_time() - me0,
    }
    cpu = sum(parts.values())
    hedge_lag, watch_lag, hedged, won = [], [], 0, 0
    for race_id in ids:
        receipt = bench.store.receipt(race_id)
        if receipt is None:
            continue
        won += receipt.get("winner") is not None
        by_role = {a["role"]: a for a in receipt["attempts"]}
        primary, hedge = by_role.get("primary"), by_role.get("hedge")
        if primary and hedge and primary.get("submitted_at_s") is not None:
            hedged += 1
            due = primary["submitted_at_s"] + hedge_after_s
            hedge_lag.append((hedge["launched_at_s"] - due) * 1000.0)
        for a in receipt["attempts"]:
            fate = ((a.get("handle") or {}).get("extra") or {}).get("sim") or {}
            if a.get("state") == "COMPLETED" and a.get("result_at_s") is not None and fate:
                end = a["submitted_at_s"] + (fate["queue_s"] + fate["run_s"]) * fate["time_scale"]
                watch_lag.append((a["result_at_s"] - end) * 1000.0)
    return {
        "row": "capacity",
        "races": races,
        "concurrent_peak": peak,
        "finished": races - len(pending),
        "won": won,
        "hedged": hedged,
        "job_s": [5 * scale, 30 * scale],
        "time_scale": scale,
        "timer_lag_ms": _summary(hedge_lag),
        "watch_lag_ms": _summary(watch_lag),
        "ramp_s": ramp_s,
        "wall_s": round(wall, 2),
        "cpu_ms_per_race": round(1000.0 * cpu / races, 1),
        "cpu_ms_per_race_by": {k: round(1000.0 * v / races, 1) for k, v in parts.items()},
        "cpu_pct": round(100.0 * cpu / wall / (os.cpu_count() or 1), 1),
        "cpus": os.cpu_count(),
        "redis_ping_p50_ms": round(statistics.median(pings), 3),
        "redis_bytes_per_race": round((peak_used - used0) / max(peak, 1)),
        "worker_rss_bytes_per_race": round((peak_rss - rss0) / max(peak, 1)),
        "worker_rss_bytes": peak_rss,
        "what": "races started over a ramp; timer lag = hedge launch - its due time; "
        "watch lag = a finished job seen - its end; memory: growth at the peak / races in flight",
    }


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--overhead-races", type=click.IntRange(1), default=1000, show_default=True,
              help="Races (and round trips) in the overhead row.")  # fmt: skip
@click.option("--races", default="1000,2400,2800", show_default=True,
              help="Races in the capacity row (a comma list: one row each).")  # fmt: skip
@click.option("--duration-s", type=click.FloatRange(0.5), default=30.0, show_default=True,
              help="Real seconds of the longest (30 provider s) capacity-row job.")  # fmt: skip
@click.option("--ramp-s", type=click.FloatRange(0.1), default=None,
              help="Seconds over which the capacity row starts its races "
              "[default: half the longest job, 15 s at --duration-s 30].")  # fmt: skip
@click.option("--cancel-races", type=click.IntRange(1), default=200, show_default=True,
              help="Races in the cancel row.")  # fmt: skip
@click.option("--workers", type=click.IntRange(1, 16), default=2, show_default=True,
              help="Coordination worker processes.")  # fmt: skip
@click.option("--concurrency", type=click.IntRange(1, 256), default=8, show_default=True,
              help="Threads per worker.")  # fmt: skip
@click.option("--rows", default="overhead,capacity,cancel", show_default=True,
              help="Comma-separated rows to run.")  # fmt: skip
@click.option("--seed", type=int, default=1, show_default=True, help="Random seed.")
def command(as_json: bool, overhead_races: int, races: str, duration_s: float,
            ramp_s: float | None, cancel_races: int, workers: int, concurrency: int, rows: str,
            seed: int) -> None:  # fmt: skip
    """Race overhead vs a Celery round trip, concurrent-race capacity, and cancel latency."""
    wanted = [r.strip() for r in rows.split(",") if r.strip()]
    unknown = set(wanted) - {"overhead", "capacity", "cancel"}
    if unknown:
        raise click.BadParameter(f"unknown row(s) {sorted(unknown)}", param_hint="--rows")
    try:
        levels = [int(x) for x in races.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise click.BadParameter(f"expected counts like 2000 or 500,1000, got {races!r}",
                                 param_hint="--races")  # fmt: skip
    root = click.get_current_context().find_root().obj
    url = None if shutil.which("redis-server") else root.settings.redis_url
    results: list[dict[str, Any]] = []
    scale = duration_s / 30.0
    # The zero-latency rows and the compressed capacity row share one config: time_scale only
    # stretches the capacity row's fates (the others are zero or a few provider seconds).
    with bench_cluster(url, workers, concurrency, scale) as bench:
        if "overhead" in wanted:
            results.extend(overhead_rows(bench, overhead_races))
        if "cancel" in wanted:
            results.append(cancel_row(bench, cancel_races, scale))
        if "capacity" in wanted:
            for level in levels:
                row = capacity_row(bench, level, scale, seed, ramp_s)
                row["meets_target"] = (row["timer_lag_ms"]["p99_ms"] or 0) <= 50.0
                results.append(row)
        setup = {
            "redis": "private redis-server" if url is None else "--redis-url",
            "workers": workers,
            "threads_per_worker": concurrency,
        }
    for row in results:
        row["setup"] = setup
    if as_json:
        click.echo(json.dumps({"bench": "races", "results": results}, indent=2))
        return
    for row in results:
        click.echo(json.dumps(row))
