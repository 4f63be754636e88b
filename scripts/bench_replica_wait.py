#!/usr/bin/env python3
"""What waiting for a replica (``GPUHEDGE_REDIS_WAIT_REPLICAS=1``) adds to a race, on loopback.

Starts a private primary ``redis-server`` and one replica of it, then runs races through the
race driver in this process (no Celery: the coordination work alone), a sim primary that ends
at once, a budget cap so each race also reserves, and effects that write and publish the
caller's result the way the Celery result backend does: in the winner claim when nothing is
waited for, by a write of their own once the replica holds the claim when it is. Races with
and without the wait alternate in pairs; each race is timed from ``create`` (which submits the
primary inline, sees it end and declares it) to its return.

Usage: ``python3 scripts/bench_replica_wait.py [--races N]``; prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpuhedge_celery.config import parse_config_text  # noqa: E402
from gpuhedge_celery.core.budget import BudgetCaps  # noqa: E402
from gpuhedge_celery.providers.simledger import RedisLedger  # noqa: E402
from gpuhedge_celery.race.base import RaceParts  # noqa: E402
from gpuhedge_celery.race.budget import RaceBudget  # noqa: E402
from gpuhedge_celery.race.driver import RaceDriver  # noqa: E402
from gpuhedge_celery.race.settings import RaceSettings  # noqa: E402
from gpuhedge_celery.race.spec import build_spec  # noqa: E402
from gpuhedge_celery.store.budget import BudgetStore  # noqa: E402
from gpuhedge_celery.store.race_keys import RaceShards, ResultWrite  # noqa: E402
from gpuhedge_celery.store.races import RaceStore  # noqa: E402
from gpuhedge_celery.store.replicas import ReplicaAcks  # noqa: E402
from gpuhedge_celery.store.timers import RaceTimers  # noqa: E402

CONFIG = """
time_scale: 1.0
providers:
  p:
    role: primary
    adapter: sim
    billed_rate_per_s: 0.0003
    sim: {seed: 1, slow_probability: 0, fast: {queue_s: 0, run_s: 0}, audio: {seconds: 1}}
policy: {name: single}
timeouts: {attempt_cap_s: 120}
validator: wav
"""
CAPS = BudgetCaps(max_usd_per_request=10, ceiling_usd=1_000_000)
REQUEST = {"sim": {"p": {"queue_s": 0, "run_s": 0}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(workdir: str, *extra: str) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    port = free_port()
    args = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
            "--appendonly", "no", "--dir", workdir, *extra]  # fmt: skip
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            client.ping()
            return process, port
        except redis.ConnectionError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit(f"redis-server on port {port} did not start")


class Effects:
    """The caller's result written and published as the Celery backend would: by the claim
    (``result_write``) or, where the claim may not carry it, by ``won`` itself."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client, self.prefix, self.won_count = client, prefix, 0

    def result_write(self, race_id: str, result: dict[str, Any]) -> ResultWrite:
        return ResultWrite(f"{self.prefix}:meta:{race_id}", json.dumps(result), 60_000)

    def won(self, race_id: str, result: dict[str, Any], caller: dict[str, Any]) -> None:
        self.won_count += 1
        if not caller.get("result_stored"):
            key, value, ms = self.result_write(race_id, result)
            pipe = self.client.pipeline(transaction=False)
            pipe.set(key, value, px=ms)
            pipe.publish(key, value)
            pipe.execute()

    def launch(self, race_id: str, attempt_id: str, provider: str) -> None: ...
    def cancel(self, race_id: str, attempt_id: str, provider: str) -> None: ...
    def failed(self, *args: Any) -> None: ...
    def event(self, race_id: str, name: str, fields: dict[str, Any]) -> None: ...


def driver_for(client: redis.Redis, prefix: str, acks: ReplicaAcks) -> tuple[RaceDriver, Effects]:
    cfg = parse_config_text(CONFIG)
    ledger = RedisLedger(client, prefix)
    providers = {name: cfg.build(name, ledger=ledger) for name in cfg.providers}
    effects = Effects(client, prefix)
    parts = RaceParts(
        RaceStore(client, prefix, acks=acks),
        RaceTimers(client, RaceShards(prefix)),
        providers.__getitem__,
        effects,
        RaceSettings(events=False),
    )
    parts.budget = RaceBudget(BudgetStore(client, prefix, acks=acks), CAPS)
    return RaceDriver(parts), effects


def summary(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {
        "p50_ms": round(statistics.median(ordered), 3),
        "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))], 3),
        "mean_ms": round(statistics.fmean(ordered), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--races", type=int, default=400, help="races per mode")
    options = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="gpuhedge-wait-bench-")
    servers: list[subprocess.Popen[bytes]] = []
    try:
        primary, port = start_server(workdir, "--repl-diskless-sync-delay", "0")
        servers.append(primary)
        replica_dir = os.path.join(workdir, "replica")
        os.mkdir(replica_dir)
        replica, _ = start_server(replica_dir, "--replicaof", "127.0.0.1", str(port))
        servers.append(replica)
        client = redis.Redis(port=port, decode_responses=True)
        deadline = time.monotonic() + 10
        while client.info("replication").get("connected_slaves", 0) < 1:
            if time.monotonic() > deadline:
                raise SystemExit("the replica never connected")
            time.sleep(0.05)
        modes = {"off": ReplicaAcks(), "wait_1": ReplicaAcks(1, 1000)}
        drivers = {name: driver_for(client, f"b{name}", acks) for name, acks in modes.items()}
        spec = build_spec(parse_config_text(CONFIG), "single")
        times: dict[str, list[float]] = {name: [] for name in modes}
        for i in range(-20, options.races):  # 20 warm-up pairs, not counted
            for name in modes if i % 2 else reversed(list(modes)):
                driver, _ = drivers[name]
                started = time.perf_counter()
                driver.create(f"r{i}", REQUEST, spec, submit_first=True)
                if i >= 0:
                    times[name].append((time.perf_counter() - started) * 1000)
        for name, (_driver, effects) in drivers.items():
            if effects.won_count != options.races + 20:
                raise SystemExit(f"{name}: {effects.won_count} winners published")
        waits = client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0)
        rows = [{"mode": name, "races": len(ms), **summary(ms)} for name, ms in times.items()]
        rows[1]["waits_per_race"] = round(waits / (options.races + 20), 2)
        extra = {
            key: round(rows[1][key] - rows[0][key], 3) for key in ("p50_ms", "p99_ms", "mean_ms")
        }
        print(
            json.dumps(
                {
                    "bench": "replica_wait",
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "redis": client.info("server")["redis_version"],
                    "results": rows,
                    "wait_adds": extra,
                },
                indent=2,
            )
        )
    finally:
        for process in reversed(servers):
            process.terminate()
            process.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
