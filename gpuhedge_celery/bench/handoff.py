"""``gpuhedge-celery bench handoff``: how fast a freed GPU reaches the next waiter.

Methods, all in one run on loopback Redis (a private redis-server when one is installed):

* ``keyspace``: ours. A holder releases; a waiter in another process, queued in
  :class:`~gpuhedge_celery.store.waiter.LeaseWaiter`, wakes on the ``del`` event and claims.
  Measured from just before the release call to the waiter holding the lease.
* ``poll-10ms`` / ``poll-100ms``: a waiter polling ``SET NX`` at that interval (released at a
  random phase of its polling).
* ``redis-rtt``: one PING round trip, the floor.
* ``expiry``: the holder dies (never releases) while Redis holds 10,000 other keys with TTLs.
  Measured from the lease's TTL deadline (taken from when the claim was sent, so never early)
  to the waiter holding the GPU.
* ``dead-head``: the waiter at the head of the queue is a process killed with SIGKILL just
  before the release; the live waiter queued behind it must take the GPU. Measured from just
  before the release call to the live waiter holding the lease.
* ``dead-head-lapsed``: the same, released ``--lapse-s`` after the kill.
* ``paused-head``: the head waiter's process is paused with SIGSTOP instead (its socket stays
  open, its heartbeat is still fresh) just before the release.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from typing import Any, cast

import click

from ..store.keys import Keys, all_keys

POOL = "bench"
GPU = "bench-host:0"
WAITER = "bench-waiter"


def _ms_stats(method: str, seconds: list[float]) -> dict[str, Any]:
    ms = sorted(s * 1000 for s in seconds)

    def pct(q: float) -> float:
        return round(ms[max(0, min(len(ms) - 1, int(-(-q * len(ms) // 1)) - 1))], 3)

    return {
        "method": method,
        "n": len(ms),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "mean_ms": round(sum(ms) / len(ms), 3),
        "max_ms": round(ms[-1], 3),
    }


def _client(url: str):
    import redis

    return redis.Redis.from_url(url, decode_responses=True)


def _store(url: str, prefix: str):
    from ..store.leases import LeaseStore

    return LeaseStore(_client(url), prefix=prefix)


# -- child processes (spawned: module-level so they can be imported) -------------------------
def _lease_waiter(url: str, prefix: str, conn) -> None:
    """Acquire through the real waiter whenever told to; report when it held the lease."""
    from ..store.waiter import LeaseWaiter

    store = _store(url, prefix)
    waiter = LeaseWaiter(store, recheck_s=1.0)
    assert waiter.listener.alive
    conn.send("ready")
    while conn.recv() == "go":
        lease = waiter.acquire(POOL, WAITER, timeout_s=60)
        held_at = time.monotonic()
        store.release(lease)
        conn.send(held_at)


def _poller(url: str, key: str, interval_s: float, conn) -> None:
    """Poll ``SET key NX`` every ``interval_s`` whenever told to; report when it got the key."""
    client = _client(url)
    client.ping()
    conn.send("ready")
    while conn.recv() == "go":
        while not client.set(key, "poller", nx=True, px=30_000):
            time.sleep(interval_s)
        held_at = time.monotonic()
        client.delete(key)
        conn.send(held_at)


def _doomed_head(url: str, prefix: str, holder: str) -> None:
    """Queue as ``holder`` and wait; the parent kills this (forked) process with SIGKILL."""
    from ..store.waiter import LeaseWaiter

    try:
        LeaseWaiter(_store(url, prefix), recheck_s=1.0).acquire(POOL, holder, timeout_s=60)
    finally:
        os._exit(1)


def _spawn(target, *args):
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    if not parent.poll(60) or parent.recv() != "ready":
        proc.kill()
        raise click.ClickException("benchmark child process did not start")
    return proc, parent


def _finish(proc, conn) -> None:
    conn.send("stop")
    proc.join(10)
    if proc.is_alive():
        proc.kill()


def _wait_queued(store, expected: tuple[str, ...] = (WAITER,)) -> None:
    deadline = time.monotonic() + 10
    while store.queue(POOL) != list(expected):
        if time.monotonic() > deadline:
            raise click.ClickException(f"the queue never became {list(expected)}")
        time.sleep(0.0002)
    time.sleep(0.001)  # let it reach its wait; an earlier release would be a plain claim


def _claim(store, holder: str, ttl_ms: int):
    deadline = time.monotonic() + 10
    while (lease := store.try_claim(GPU, holder, ttl_ms=ttl_ms)) is None:
        if time.monotonic() > deadline:
            raise click.ClickException("could not re-claim the benchmark GPU")
        time.sleep(0.0001)
    return lease


# -- methods ---------------------------------------------------------------------------------
def bench_keyspace(url: str, prefix: str, n: int) -> list[float]:
    store = _store(url, prefix)
    proc, conn = _spawn(_lease_waiter, url, prefix)
    out = []
    try:
        lease = _claim(store, "bench-holder", 30_000)
        for _ in range(n):
            conn.send("go")
            _wait_queued(store)
            released = time.monotonic()
            store.release(lease)
            out.append(conn.recv() - released)
            lease = _claim(store, "bench-holder", 30_000)
        store.release(lease)
    finally:
        _finish(proc, conn)
    return out


def bench_poll(url: str, prefix: str, interval_s: float, n: int) -> list[float]:
    client = _client(url)
    key = Keys(prefix).bench_poll()
    proc, conn = _spawn(_poller, url, key, interval_s)
    out = []
    rng = random.Random(1)
    try:
        for _ in range(n):
            while not client.set(key, "holder", nx=True, px=30_000):
                time.sleep(0.0001)
            conn.send("go")
            time.sleep(interval_s * rng.random() + 0.001)
            released = time.monotonic()
            client.delete(key)
            out.append(conn.recv() - released)
    finally:
        _finish(proc, conn)
    return out


def bench_rtt(url: str, n: int) -> list[float]:
    client = _client(url)
    client.ping()
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        client.ping()
        out.append(time.monotonic() - t0)
    return out


def bench_expiry(
    url: str, prefix: str, n: int, background: int, ttl_ms: int
) -> tuple[list[float], int]:
    client = _client(url)
    pipe = client.pipeline(transaction=False)
    for i in range(background):
        # Long TTLs: they stay volatile for the whole run, as a result backend's keys do.
        pipe.set(Keys(prefix).bench_background(i), "x", ex=600 + i % 3000)
        if i % 1000 == 999:
            pipe.execute()
    pipe.execute()
    volatile = int(client.info("keyspace").get("db0", {}).get("expires", 0))
    store = _store(url, prefix)
    proc, conn = _spawn(_lease_waiter, url, prefix)
    out = []
    try:
        for _ in range(n):
            sent = time.monotonic()
            _claim(store, "dying-holder", ttl_ms)  # never released: the holder "died"
            conn.send("go")
            out.append(conn.recv() - (sent + ttl_ms / 1000))
    finally:
        _finish(proc, conn)
    return out, volatile


def bench_dead_head(
    url: str, prefix: str, n: int, lapse_s: float, *, pause: bool = False
) -> list[float]:
    """Release with a killed (or, with ``pause``, SIGSTOPped) waiter at the head of the queue;
    the live one behind must take the GPU."""
    store = _store(url, prefix)
    proc, conn = _spawn(_lease_waiter, url, prefix)
    fork = multiprocessing.get_context("fork")  # this process runs no threads; forking is cheap
    out = []
    try:
        lease = _claim(store, "bench-holder", 30_000)
        for i in range(n):
            victim = f"bench-dead-{i}"
            head = fork.Process(target=_doomed_head, args=(url, prefix, victim), daemon=True)
            head.start()
            _wait_queued(store, (victim,))
            conn.send("go")
            _wait_queued(store, (victim, WAITER))
            if pause:
                os.kill(cast(int, head.pid), signal.SIGSTOP)  # started
            else:
                head.kill()
                head.join(10)
            time.sleep(lapse_s)
            released = time.monotonic()
            store.release(lease)
            out.append(conn.recv() - released)
            if pause:
                head.kill()  # SIGKILL ends a stopped process too
                head.join(10)
            # Clear what the dead process left behind, so every sample starts alike.
            store.client.zrem(store.keys.waiters(POOL), victim)
            store.client.hdel(store.keys.waitinfo(POOL), victim)
            lease = _claim(store, "bench-holder", 30_000)
        store.release(lease)
    finally:
        _finish(proc, conn)
    return out


# -- plumbing --------------------------------------------------------------------------------
def _private_redis() -> tuple[str, subprocess.Popen, str] | None:
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="gpuhedge-bench-")
    args = [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--dir", workdir]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            _client(url).ping()
            return url, proc, workdir
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.05)
    proc.kill()
    raise click.ClickException("the private redis-server for the benchmark did not start")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
@click.option("--n", default=1000, show_default=True, help="Keyspace handoffs and RTT samples.")
@click.option("--expiries", default=200, show_default=True, help="Expiry samples.")
@click.option("--background-keys", default=10_000, show_default=True, help="Other TTL keys.")
@click.option("--expiry-ttl-ms", default=50, show_default=True, help="Dying holder's TTL.")
@click.option("--dead-heads", default=100, show_default=True, help="Releases past a dead head.")
@click.option("--lapsed-heads", default=20, show_default=True, help="... released after --lapse-s.")
@click.option("--lapse-s", default=1.5, show_default=True, help="Kill-to-release delay, lapsed.")
@click.option("--shared", is_flag=True, help="Use --redis-url even if redis-server exists.")
def command(
    as_json: bool,
    n: int,
    expiries: int,
    background_keys: int,
    expiry_ttl_ms: int,
    dead_heads: int,
    lapsed_heads: int,
    lapse_s: float,
    shared: bool,
) -> None:
    """Handoff latency: keyspace events vs polling vs RTT, after an unreleased lease expires,
    and past a dead waiter at the head of the queue."""
    from ..store.leases import GpuInfo

    if min(n, expiries, expiry_ttl_ms, dead_heads, lapsed_heads) < 1 or background_keys < 0:
        raise click.BadParameter(
            "--n, --expiries, --expiry-ttl-ms, --dead-heads, --lapsed-heads must be >= 1"
        )
    if not lapse_s >= 0:
        raise click.BadParameter(f"--lapse-s must be >= 0, got {lapse_s!r}")
    private = None if shared else _private_redis()
    settings = click.get_current_context().find_root().obj.settings
    url = private[0] if private else settings.redis_url
    prefix = f"{settings.prefix}-bench-{uuid.uuid4().hex[:8]}"
    try:
        store = _store(url, prefix)
        with store.guard():
            version = store.client.info("server").get("redis_version")
        store.register_gpu(GpuInfo(GPU, POOL, "bench-host"))
        store.host_heartbeat("bench-host", 3_600_000)
        results = [
            _ms_stats("keyspace", bench_keyspace(url, prefix, n)),
            _ms_stats("poll-10ms", bench_poll(url, prefix, 0.010, min(n, 300))),
            _ms_stats("poll-100ms", bench_poll(url, prefix, 0.100, min(n, 100))),
            _ms_stats("redis-rtt", bench_rtt(url, n)),
        ]
        samples, volatile = bench_expiry(url, prefix, expiries, background_keys, expiry_ttl_ms)
        expiry = _ms_stats("expiry", samples)
        expiry.update(volatile_keys=volatile, lease_ttl_ms=expiry_ttl_ms)
        results.append(expiry)
        results.append(_ms_stats("dead-head", bench_dead_head(url, prefix, dead_heads, 0.0)))
        lapsed = _ms_stats("dead-head-lapsed", bench_dead_head(url, prefix, lapsed_heads, lapse_s))
        lapsed.update(released_after_kill_s=lapse_s)
        results.append(lapsed)
        paused = bench_dead_head(url, prefix, dead_heads, 0.0, pause=True)
        results.append(_ms_stats("paused-head", paused))
    finally:
        if private:
            private[1].terminate()
            private[1].wait(10)
            shutil.rmtree(private[2], ignore_errors=True)
        else:
            client = _client(url)
            for key in client.scan_iter(all_keys(prefix), count=1000):
                client.delete(key)
    report = {
        "bench": "handoff",
        "redis": f"{'private redis-server' if private else 'shared'} {version}",
        "results": results,
    }
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for r in results:
        p50, p99 = r["p50_ms"], r["p99_ms"]
        click.echo(f"{r['method']:<16} n={r['n']:<5} p50 {p50:>8.3f} ms  p99 {p99:>8.3f} ms")
