"""``gpuhedge-celery bench races``: a race's overhead, how many fit, how fast losers stop.

The benchmark starts its own real Celery workers (coordination role, threads pool) on a private
``redis-server`` when one is installed and no ``--redis-url`` is on the command line (else on
that Redis, under a fresh key prefix that is deleted afterwards; a Redis Cluster there, with
``GPUHEDGE_BROKER_URL`` naming the broker's own Redis, gives per-primary Redis CPU) and sim
providers from a generated config. Rows:

* ``overhead``: races with a zero-latency sim provider (``single`` policy), one at a time;
  end-to-end time at the client (``send_task`` to ``.get()`` returning) minus the winning
  provider's own latency, p50/p99; beside it, in the same run and alternating with it,
  ``celery-roundtrip``: a trivial task's ``.delay().get()`` on the same broker and workers.
* ``capacity``: ``--races`` races started within a short ramp, with sim jobs of 5-30 provider
  seconds (``--duration-s`` compresses them so the longest takes that many real seconds) and a
  hedge timer half-way; measures the peak number of races in flight, timer lag (the hedge
  timer's launch and the watch timer that sees a job finish, against their due times), CPU %
  of the whole machine (workers, Redis and this client), Redis and worker memory per race, and
  Redis traffic per race: round trips, bytes and commands beside the payload's size
  (:mod:`.race_capacity`, which holds the row).
* ``cancel``: races where the hedge wins while the primary still runs; time from the winner's
  validation (``won_at``) to the loser's native cancel call (recorded by the sim ledger).
* ``floor`` (only when asked for): right after the first capacity row, on the same workers, as
  many plain Celery tasks as it has races, over the same ramp and window, each returning the
  same payload: the part of a race's CPU and Redis traffic that is Celery's own, and the rest
  (:mod:`.celery_floor`).
* ``records`` (only when asked for): the capacity row's CPU per race with race records on and
  off (``GPUHEDGE_RECORDS_MAXLEN``), in alternating pairs of fresh clusters
  (:mod:`._records_pair`).
* ``memory`` (only when asked for): Redis bytes per race in flight and per finished race
  (``bench/race_memory.py``).

``--provider runpod-fake`` runs each capacity row a second time on two RunPod endpoints of a
loopback fake in its own process (``bench/races_runpod.py``): provider HTTP requests per job
and the most requests per 10 s window per route, against RunPod's limits. ``--webhooks on``
also runs the webhook receiver (its CPU counted per race): jobs report their end by webhook.
* ``truth`` (only when asked for): ``--truth-races`` cutover races on the RunPod fake with
  webhooks, a capped budget and refused cancels; every receipt, race record and ledger
  settlement against the fake's truth of what each job billed (:mod:`._truth_row`).
* ``metrics``: the capacity row's CPU per race with metrics off and on (each worker's endpoint
  scraped every second), fresh workers per run, alternating pairs
  (:mod:`gpuhedge_celery.bench.metrics_cost`). Not in the default rows.

Numbers are measured, never estimated; the JSON says what was run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, cast

import click
from click.core import ParameterSource

from .. import envvars, names
from ..settings import ProcessSettings
from ..store.keys import all_keys
from . import redis_probe
from ._checkout import runpod_fake
from ._procs import cpu_s as _cpu_s
from ._procs import free_port as _free_port
from .race_capacity import _summary, capacity_row, meets_capacity_target

FLOOR_PLUGIN = f"{__package__}.celery_floor"  # imported by the workers, not here

CONFIG = """
time_scale: {scale}
providers:
  p:
    role: primary
    adapter: sim
    billed_rate_per_s: 0.0003
    sim: {{seed: 1, slow_probability: 0, fast: {{queue_s: 0, run_s: 0}},
          cancel: {{ack_s: 0.05, terminal_s: 0.1}}, audio: {{seconds: {audio_s}}}}}
  h:
    role: hedge
    adapter: sim
    billed_rate_per_s: 0.0007
    sim: {{seed: 2, slow_probability: 0, fast: {{queue_s: 0, run_s: 0}},
          cancel: {{ack_s: 0.05, terminal_s: 0.1}}, audio: {{seconds: {audio_s}}}}}{extra}
policy:
  name: fixed
  params: {{hedge_after_ms: 10000}}
timeouts:
  attempt_cap_s: 120
validator: wav
"""


class Bench:
    """Workers, Redis and a client app for one benchmark run; :meth:`close` cleans up.

    ``metrics``: None leaves the environment's metric settings; False turns metrics off
    (``GPUHEDGE_METRICS=0``); True gives each worker its own endpoint (``metrics_ports``).
    """

    def __init__(
        self,
        redis_url: str | None,
        workers: int,
        concurrency: int,
        scale: float,
        extra_env: dict[str, str] | None = None,
        provider: str = "sim",
        metrics: bool | None = None,
        webhooks: bool = False,
        extra_config: str = "",
        receiver_workers: int = 1,
        webhook_senders: int = 8,
        audio_s: float = 1.0,
    ):
        self.metrics = metrics
        self.metrics_ports: list[int] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="gpuhedge-bench-races-"))
        self.receiver: subprocess.Popen | None = None  # the webhook receiver (--webhooks on)
        self.receiver_workers = 0  # its processes
        self.redis_proc: subprocess.Popen | None = None
        self.fake: Any = None  # the RunPod fake, in its own process (--provider runpod-fake)
        self.redis_url = redis_url or self._start_redis()
        self.prefix = f"bench{uuid.uuid4().hex[:8]}"
        config = self.tmp / "bench.yaml"
        extra = ""
        if provider == "runpod-fake":
            from . import races_runpod

            self.fake = races_runpod.start_fake(webhook_senders)
            extra = races_runpod.providers_yaml(self.fake)
            if "budget:" not in extra_config:  # a paid adapter needs a ceiling (docs/costs.md)
                extra_config += "budget: {ceiling_usd: 1000000}\n"
        text = CONFIG.format(scale=scale, extra=extra, audio_s=audio_s)
        config.write_text(text + extra_config)  # e.g. a budget
        self.env = {
            **os.environ,
            "GPUHEDGE_REDIS_URL": self.redis_url,
            "GPUHEDGE_PREFIX": self.prefix,
            "GPUHEDGE_BROKER_PREFIX": f"{self.prefix}:",
            "GPUHEDGE_CONFIG": str(config),
            "GPUHEDGE_COORD_CONCURRENCY": str(concurrency),
            "GPUHEDGE_BENCH_RUNPOD_KEY": "bench-runpod-key",
            "PYTHONUNBUFFERED": "1",
            **(extra_env or {}),
        }
        # each worker counts its Redis round trips into files here (bench/redis_probe.py)
        self.probe_dir = self.tmp / "probe"
        plugins = list(ProcessSettings.from_env(self.env).race.plugins)
        # and register the Celery floor's task (bench/celery_floor.py)
        self.env["GPUHEDGE_PLUGINS"] = ",".join([*plugins, redis_probe.__name__, FLOOR_PLUGIN])
        self.env[redis_probe.DIR_ENV] = str(self.probe_dir)
        for name in (
            envvars.GPU_VAR,
            "CUDA_VISIBLE_DEVICES",
            envvars.METRICS_PORT_VAR,
            "PROMETHEUS_MULTIPROC_DIR",
        ):
            self.env.pop(name, None)
        if webhooks:
            from . import races_runpod

            self.receiver = races_runpod.start_receiver(self.env, self.tmp, receiver_workers)
            self.receiver_workers = receiver_workers
        self.workers: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        for i in range(workers):
            self._start_worker(i)
        self._wait_ready()
        from ..config import load_config
        from ..providers.simledger import RedisLedger
        from ..store.connection import redis_from_url
        from ..store.races import RaceStore
        from ..tasks.app import create_app
        from ..tasks.config import GlueConfig

        self.app = create_app(GlueConfig.from_env(self.env))
        self.client = redis_from_url(self.redis_url, decode_responses=True)
        self.store = RaceStore(
            self.client, ProcessSettings.from_env(self.env).race_shards(self.prefix)
        )  # the shards the workers put races on
        self.ledger = RedisLedger(self.client, self.prefix)
        self.config = load_config(str(config))

    def _start_redis(self) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            raise click.UsageError("no redis-server installed: pass --redis-url")
        port = _free_port()
        self.redis_proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.tmp),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
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
        env = dict(self.env)
        if self.metrics is False:
            env["GPUHEDGE_METRICS"] = "0"
        elif self.metrics:
            self.metrics_ports.append(_free_port())
            env.update(
                GPUHEDGE_METRICS="1",
                GPUHEDGE_METRICS_ADDR="127.0.0.1",
                GPUHEDGE_METRICS_PORT=str(self.metrics_ports[-1]),
            )
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "gpuhedge_celery",
            "worker",
            "-n",
            f"bench{i}.{self.prefix}@localhost",
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        with open(log, "wb") as out:
            self.workers.append(
                subprocess.Popen(
                    argv,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=str(self.tmp),
                    start_new_session=True,
                )
            )
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

    def redis_nodes(self) -> list[Any]:
        """A plain client of each Redis primary holding the store (the one server, or every
        primary of a cluster store)."""
        from ..store.cluster import ClusterClient

        if isinstance(self.client, ClusterClient):
            cluster = self.client.cluster
            return [cluster.get_redis_connection(n) for n in cluster.get_primaries()]
        return [self.client]

    def redis_info_sum(self, section: str, field: str) -> float:
        """``field`` of INFO ``section`` summed over the store's primaries."""
        return sum(float(node.info(section)[field]) for node in self.redis_nodes())

    def redis_cpu_by_node(self) -> list[float]:
        """CPU seconds each of the store's primaries has used so far."""
        infos = [node.info("cpu") for node in self.redis_nodes()]
        return [float(i["used_cpu_sys"]) + float(i["used_cpu_user"]) for i in infos]

    def redis_cpu_s(self) -> float:
        return sum(self.redis_cpu_by_node())

    def send(self, request: dict[str, Any], **kwargs: Any) -> Any:
        return self.app.send_task(
            names.TASK_HEDGED_INFER, (request,), kwargs, queue=names.QUEUE_COORD
        )

    def close(self) -> None:
        if self.fake is not None:
            self.fake.stop()
        if self.receiver is not None:
            from .races_runpod import stop_receiver

            stop_receiver(self.receiver)
        for p in self.workers:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
        try:
            if self.redis_proc is None:
                keys = list(self.client.scan_iter(all_keys(self.prefix), count=1000))
                for i in range(0, len(keys), 1000):
                    self.client.delete(*keys[i : i + 1000])
        finally:
            if self.redis_proc is not None:
                self.redis_proc.kill()
                self.redis_proc.wait(10)
            shutil.rmtree(self.tmp, ignore_errors=True)


@contextmanager
def bench_cluster(
    redis_url: str | None,
    workers: int,
    concurrency: int,
    scale: float,
    extra_env: dict[str, str] | None = None,
    provider: str = "sim",
    metrics: bool | None = None,
    webhooks: bool = False,
    extra_config: str = "",
    receiver_workers: int = 1,
    webhook_senders: int = 8,
    audio_s: float = 1.0,
) -> Iterator[Bench]:
    """A :class:`Bench` that is always cleaned up."""
    bench = Bench(
        redis_url,
        workers,
        concurrency,
        scale,
        extra_env,
        provider,
        metrics,
        webhooks,
        extra_config,
        receiver_workers,
        webhook_senders,
        audio_s,
    )
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
        bench.app.send_task("celery.accumulate", (1,), queue=names.QUEUE_COORD).get(timeout=30)
    race_ms, coord_ms, trip_ms = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        result = bench.send(zero, policy="single", providers=["p"]).get(timeout=30)
        total = (time.perf_counter() - t0) * 1000.0
        race_ms.append(total - float(result.get("provider_ms") or 0.0))
        coord_ms.append(float(result["e2e_ms"]))
        t0 = time.perf_counter()
        bench.app.send_task("celery.accumulate", (1,), queue=names.QUEUE_COORD).get(timeout=30)
        trip_ms.append((time.perf_counter() - t0) * 1000.0)
    race = {"row": "overhead", **_summary(race_ms)}
    race["coordinator_e2e"] = _summary(coord_ms)
    race["what"] = "client send_task -> .get() minus the winner's provider_ms; zero-latency sim"
    trip = {"row": "celery-roundtrip", **_summary(trip_ms)}
    trip["what"] = "celery.accumulate .delay().get() on the same broker and workers"
    return [race, trip]


def _floor(
    bench: Bench, tasks: int, scale: float, ramp_s: float | None, capacity: dict[str, Any] | None
) -> dict[str, Any]:
    """The Celery floor row, over the capacity row's ramp and window when it is beside one."""
    from .celery_floor import beside_capacity, floor_row

    if capacity is None:
        return floor_row(bench, tasks, 15.0 * scale if ramp_s is None else ramp_s)
    floor = floor_row(bench, tasks, capacity["ramp_s"], capacity["wall_s"])
    floor["beside_capacity"] = beside_capacity(floor, capacity)
    return floor


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
    delays: list[float] = []
    warm: list[float] = []
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


# (flag, type, default, help) of every ``bench races`` option but --json, in --help's order
_OPTIONS: tuple[tuple[str, Any, Any, str], ...] = (
    ("--overhead-races", click.IntRange(1), 1000, "Races (and round trips) in the overhead row."),
    ("--races", None, "1000,2400,2800", "Races in the capacity row (a comma list: one row each)."),
    (
        "--duration-s",
        click.FloatRange(0.5),
        30.0,
        "Real seconds of the longest (30 provider s) capacity-row job.",
    ),
    (
        "--ramp-s",
        click.FloatRange(0.1),
        None,
        "Seconds over which the capacity row starts its races "
        "[default: half the longest job, 15 s at --duration-s 30].",
    ),
    ("--cancel-races", click.IntRange(1), 200, "Races in the cancel row."),
    ("--workers", click.IntRange(1, 16), 2, "Coordination worker processes."),
    ("--concurrency", click.IntRange(1, 256), 8, "Threads per worker."),
    ("--memory-races", click.IntRange(1), 200, "Races in the memory row."),
    (
        "--request-bytes",
        click.IntRange(100),
        1000,
        "Size of each memory-row race's request (JSON bytes, about).",
    ),
    (
        "--rows",
        None,
        "overhead,capacity,cancel",
        "Rows to run, comma-separated (also: floor, records, memory, metrics, budget, truth).",
    ),
    (
        "--record-pairs",
        click.IntRange(1, 20),
        3,
        "records row: alternating off/on pairs of capacity runs.",
    ),
    ("--metrics-races", click.IntRange(1), 600, "Races per run in the metrics row."),
    (
        "--metrics-duration-s",
        click.FloatRange(0.5),
        10.0,
        "Real seconds of the longest job in the metrics row's runs.",
    ),
    ("--metrics-pairs", click.IntRange(1), 3, "Off/on pairs in the metrics row."),
    (
        "--budget-races",
        click.IntRange(10),
        600,
        "Hedged races per side in the budget row (budgets off, then on).",
    ),
    ("--budget-pairs", click.IntRange(1, 10), 2, "Alternating off/on pairs in the budget row."),
    ("--truth-races", click.IntRange(10, 2000), 300, "truth row: races started within 10 s."),
    ("--seed", int, 1, "Random seed."),
    (
        "--provider",
        click.Choice(["sim", "runpod-fake"]),
        "sim",
        "runpod-fake: also run each capacity row on RunPod "
        "endpoints of a loopback fake in its own process (see --webhooks), beside the "
        "sim row of the same run.",
    ),
    (
        "--webhooks",
        click.Choice(["off", "on"]),
        "off",
        "on: run the webhook receiver too; RunPod jobs report their end by webhook "
        "and are polled only before decisions and as a 30 s safety net.",
    ),
    (
        "--receiver-workers",
        click.IntRange(1, 16),
        1,
        "With --webhooks on: receiver processes (webhooks --workers N).",
    ),
    (
        "--webhook-senders",
        click.IntRange(1, 256),
        8,
        "The RunPod fake's webhook delivery threads.",
    ),
    (
        "--audio-s",
        click.FloatRange(0.01, 600),
        1.0,
        "Seconds of 16 kHz WAV each sim job returns: the payload's size (1 s: 42.7 "
        "KB as base64 JSON) in the overhead, capacity, cancel and memory rows.",
    ),
)


def _bench_options(fn: Any) -> Any:
    """Declare :data:`_OPTIONS` on ``fn``, each with its default shown (none for a None)."""
    for flag, kind, default, text in reversed(_OPTIONS):  # the last applied is listed first
        fn = click.option(flag, type=kind, default=default, show_default=True, help=text)(fn)
    return fn


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@_bench_options
def command(
    as_json: bool,
    overhead_races: int,
    races: str,
    duration_s: float,
    ramp_s: float | None,
    cancel_races: int,
    workers: int,
    concurrency: int,
    memory_races: int,
    request_bytes: int,
    rows: str,
    record_pairs: int,
    metrics_races: int,
    metrics_duration_s: float,
    metrics_pairs: int,
    budget_races: int,
    budget_pairs: int,
    truth_races: int,
    seed: int,
    provider: str,
    webhooks: str,
    receiver_workers: int,
    webhook_senders: int,
    audio_s: float,
) -> None:
    """Race overhead vs a Celery round trip, concurrent-race capacity, and cancel latency."""
    wanted = [r.strip() for r in rows.split(",") if r.strip()]
    unknown = set(wanted) - {
        "overhead",
        "capacity",
        "cancel",
        "floor",
        "records",
        "memory",
        "metrics",
        "budget",
        "truth",
    }
    if unknown:
        raise click.BadParameter(f"unknown row(s) {sorted(unknown)}", param_hint="--rows")
    if provider == "runpod-fake" or "truth" in wanted:
        runpod_fake()  # a wheel install has none: say so before any process starts
    try:
        levels = [int(x) for x in races.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise click.BadParameter(
            f"expected counts like 2000 or 500,1000, got {races!r}", param_hint="--races"
        )
    root_ctx = click.get_current_context().find_root()
    root = root_ctx.obj
    # a private redis-server unless the Redis was named on the command line (a cluster, say)
    named = root_ctx.get_parameter_source("redis_url") is ParameterSource.COMMANDLINE
    url = root.settings.redis_url if named or not shutil.which("redis-server") else None
    results: list[dict[str, Any]] = []
    scale = duration_s / 30.0
    if "records" in wanted:  # fresh clusters of its own, one per run
        from ._records_pair import records_row

        results.append(
            records_row(
                bench_cluster,
                capacity_row,
                url,
                workers,
                concurrency,
                scale,
                levels[0],
                record_pairs,
                seed,
                ramp_s,
            )
        )
        wanted.remove("records")
    setup = {
        "redis": "private redis-server" if url is None else "--redis-url",
        "workers": workers,
        "threads_per_worker": concurrency,
        "webhooks": webhooks,
        "receiver_processes": receiver_workers if webhooks == "on" else 0,
        "fake_webhook_senders": webhook_senders,
    }
    # The zero-latency rows and the compressed capacity row share one config: time_scale only
    # stretches the capacity row's fates (the others are zero or a few provider seconds).
    if "budget" in wanted:  # its own workers: budgets off, then on, in alternating pairs
        from ._budget_row import Tools, budget_row

        tools = Tools(bench_cluster, _cpu_s, _wait_receipt)
        results.append(budget_row(tools, url, workers, concurrency, budget_races, budget_pairs))
        wanted.remove("budget")
    if "truth" in wanted:  # its own workers, in real time, on the RunPod fake
        from ._truth_row import truth_row

        results.append(truth_row(bench_cluster, url, workers, concurrency, truth_races))
        wanted.remove("truth")
    if "metrics" in wanted:  # fresh workers for each of its runs
        from .metrics_cost import metrics_row

        def cluster(on: bool, scale: float) -> Any:
            return bench_cluster(url, workers, concurrency, scale, metrics=on)

        results.append(
            metrics_row(
                cluster, capacity_row, metrics_races, metrics_duration_s, metrics_pairs, seed
            )
        )
        wanted.remove("metrics")
    hooks: dict[str, Any] = {
        "webhooks": webhooks == "on",
        "receiver_workers": receiver_workers,
        "webhook_senders": webhook_senders,
        "audio_s": audio_s,
    }
    with (
        bench_cluster(url, workers, concurrency, scale, provider=provider, **hooks)
        if wanted
        else nullcontext()
    ) as maybe_bench:
        bench = cast(Bench, maybe_bench)  # None only when no row needs the cluster
        if "overhead" in wanted:
            results.extend(overhead_rows(bench, overhead_races))
        if "cancel" in wanted:
            results.append(cancel_row(bench, cancel_races, scale))
        if "memory" in wanted:
            from .race_memory import memory_row

            results.append(memory_row(bench, memory_races, request_bytes, scale))
        first_capacity: dict[str, Any] | None = None
        if "capacity" in wanted:
            for level in levels:
                row = capacity_row(bench, level, scale, seed, ramp_s)
                row["meets_target"] = meets_capacity_target(row)
                results.append(row)
                first_capacity = first_capacity or row
                if provider == "runpod-fake":  # the same races on RunPod, beside the sim row
                    rp = capacity_row(bench, level, scale, seed, ramp_s, provider)
                    rp["meets_target"] = meets_capacity_target(rp)
                    rp["cpu_vs_sim"] = round(rp["cpu_ms_per_race"] / row["cpu_ms_per_race"], 2)
                    results.append(rp)
                if "floor" in wanted and row is first_capacity:  # right after the row it is beside
                    results.append(_floor(bench, level, scale, ramp_s, row))
        if "floor" in wanted and first_capacity is None:
            results.append(_floor(bench, levels[0], scale, ramp_s, None))
    for row in results:
        row["setup"] = setup
    if as_json:
        click.echo(json.dumps({"bench": "races", "results": results}, indent=2))
        return
    for row in results:
        click.echo(json.dumps(row))
