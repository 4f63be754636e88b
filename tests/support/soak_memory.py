"""The soak's view of memory: the workers' resident set size, and Redis's memory by part, by
kind of key and over time (``tests/support/soak.py`` samples it; ``docs/reliability.md`` says what
the soak found)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


SERIES_FIELDS = ("s", "worker_rss_mb", "redis_used_mb", "sim_ledger_mb", "record_stream_mb",
                 "dataset_mb", "client_buffers_mb", "broker_mb", "expired_stale_pct",
                 "redis_after_reclaim_mb")  # fmt: skip


def memory_sample(cluster, at_s: float, reclaim: bool = False) -> tuple[float, ...]:
    """One row of ``series`` (SERIES_FIELDS); Redis's parts 0 while it restarts.

    ``expired_stale_pct`` is Redis's own estimate of the keys whose TTL has passed but that it
    has not reclaimed yet (INFO ``expired_stale_perc``): Redis deletes an expired key when it
    is read, or when its background cycle, sampling keys that have a TTL, happens on it. With
    ``reclaim`` the sample then reads every key name (``SCAN``, which deletes the expired keys
    it passes) and Redis's memory again: ``redis_after_reclaim_mb``, what the keys still alive
    hold (0 without ``reclaim``)."""
    from gpuhedge_celery.store.records import RecordStream

    live = [w for w in cluster.workers if w.alive() and "@" in w.nodename]
    rss = round(sum(rss_mb(w.pid) for w in live) / max(1, len(live)), 1)
    parts = [0.0] * 8
    with contextlib.suppress(Exception):
        client = cluster.client
        info = client.info("memory")
        stale = float(client.info("stats").get("expired_stale_perc", 0.0))
        keys = RecordStream(client, cluster.prefix).keys  # the workers' shards (default one)
        stream = sum(client.memory_usage(key, samples=0) or 0 for key in keys)
        parts = [info["used_memory"] / 2**20, sim_ledger_mb(client, cluster.prefix),
                 stream / 2**20, info["used_memory_dataset"] / 2**20,
                 info.get("mem_clients_normal", 0) / 2**20, broker_mb(client), stale,
                 0.0]  # fmt: skip
        if reclaim:
            for _ in client.scan_iter(count=1000):
                pass
            parts[7] = client.info("memory")["used_memory"] / 2**20
    return (at_s, rss, *(round(p, 2) for p in parts))


def broker_mb(client) -> float:
    """Memory of the broker's queues (lists) and unacknowledged messages (kombu's hashes)."""
    keys = list(client.scan_iter(count=1000, _type="list"))
    keys += [k for k in client.scan_iter(match="*unacked*", count=1000)]
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.memory_usage(key, samples=0)
    return sum(n or 0 for n in pipe.execute()) / 2**20 if keys else 0.0


def growth_per_min(samples: list[tuple[float, ...]], column: int = 2) -> float | None:
    """Least-squares slope (MB a minute) of Redis's memory (``column``) without the sim
    ledger over the second half of the samples (the first half fills the TTL-bounded keys)."""
    rows = [(s[0], s[column] - s[3]) for s in samples[len(samples) // 2 :] if s[column] > 0]
    if len(rows) < 3:
        return None
    mean_t = sum(t for t, _ in rows) / len(rows)
    mean_m = sum(m for _, m in rows) / len(rows)
    var = sum((t - mean_t) ** 2 for t, _ in rows)
    cov = sum((t - mean_t) * (m - mean_m) for t, m in rows)
    return round(cov / var * 60, 3) if var else None


def sim_ledger_mb(client, prefix: str) -> float:
    """Memory of the sim fake's per-job ledger (its keys live a day: test scaffolding, kept
    apart so that the product's own keys can be seen to level off)."""
    total = 0
    keys = list(client.scan_iter(match=f"{prefix}:sim:*", count=1000))
    for start in range(0, len(keys), 1000):
        pipe = client.pipeline(transaction=False)
        for key in keys[start : start + 1000]:
            pipe.memory_usage(key)
        total += sum(n or 0 for n in pipe.execute())
    return total / 2**20


def memory_parts(client) -> dict[str, float]:
    """Where Redis's memory is at the end (MB): data, overhead, scripts, client buffers, AOF."""
    info = client.info("memory")
    parts = ("used_memory_dataset", "used_memory_overhead", "used_memory_scripts",
             "mem_clients_normal", "mem_clients_slaves", "mem_aof_buffer",
             "used_memory_lua")  # fmt: skip
    found = {name: round(info[name] / 2**20, 2) for name in parts if name in info}
    found["keys"] = client.dbsize()
    found["biggest_keys_kb"] = biggest_keys(client)
    found["by_kind_mb"] = memory_by_kind(client)
    return found


def memory_by_kind(client, top: int = 15) -> dict[str, float]:
    """Redis memory by kind of key (MB, exact ``MEMORY USAGE ... SAMPLES 0``), the largest
    first: a kind whose total grows between two snapshots is where memory goes."""
    totals: dict[str, int] = {}
    keys = list(client.scan_iter(count=1000))
    for start in range(0, len(keys), 1000):
        batch = keys[start : start + 1000]
        pipe = client.pipeline(transaction=False)
        for key in batch:
            pipe.memory_usage(key, samples=0)
        for key, n in zip(batch, pipe.execute(), strict=True):
            kind = key_kind(key)
            totals[kind] = totals.get(kind, 0) + (n or 0)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {kind: round(n / 2**20, 3) for kind, n in ranked}


def key_kind(key: str) -> str:
    """A key's name with its ids replaced by ``*``."""
    return re.sub(r"\{[^}]*\}|[0-9a-f]{8}-[0-9a-f-]{27}|[0-9a-f]{10,}", "*", key)


def biggest_keys(client, top: int = 8) -> dict[str, float]:
    """The largest keys at the end (KB, by ``MEMORY USAGE``): one key can hold many entries
    (a stream, a hash of timers, the broker's unacknowledged messages), which the census by
    kind counts once."""
    keys = list(client.scan_iter(count=1000))
    sizes: list[tuple[int, str]] = []
    for start in range(0, len(keys), 1000):
        pipe = client.pipeline(transaction=False)
        batch = keys[start : start + 1000]
        for key in batch:
            pipe.memory_usage(key, samples=0)
        sizes.extend(zip((n or 0 for n in pipe.execute()), batch, strict=True))
    sizes.sort(reverse=True)
    return {key: round(n / 1024, 1) for n, key in sizes[:top]}


def key_census(client, limit: int = 200_000) -> dict[str, int]:
    """Keys in Redis at the end, by kind (the part of the name that is not an id)."""
    kinds: dict[str, int] = {}
    for i, key in enumerate(client.scan_iter(count=1000)):
        if i >= limit:
            break
        kind = key_kind(key)
        kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:15])
