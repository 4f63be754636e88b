"""``gpuhedge-celery bench races --rows memory``: how much Redis memory one race costs.

Races with a given request size run on the bench's real workers (policy ``hedge:p->h@H``: the
primary runs 3 H, the hedge launched at H wins at 2 H and the primary is cancelled). The row
samples Redis three times: while the primary runs alone (hedge timer armed), while both
attempts run, and once every race has finished. Each time it reads ``MEMORY USAGE key SAMPLES
0`` of every key that names a race (``race:{<shard>}:<id>:*`` and Celery's
``celery-task-meta-<id>``), grouped by what the key is, and ``INFO memory``'s ``used_memory``
growth over the baseline (which also counts what races share: the timer and heartbeat sets,
broker messages), each divided by the races in that phase.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import defaultdict
from typing import Any

from ..store.keys import all_keys

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _kind(key: str, race_id: str) -> str:
    """What a key of race ``race_id`` holds: ``state``, ``jobs``, ``result``, ``celery-meta``..."""
    if "celery-task-meta-" in key:
        return "celery-meta"
    tail = key.split(f"}}:{race_id}:", 1)[-1]
    return tail.split(":", 1)[0]


def _race_keys(client: Any, prefix: str, race_ids: set[str]) -> dict[str, list[str]]:
    """Race id -> every key under ``prefix`` that names it (one SCAN of the prefix)."""
    found: dict[str, list[str]] = defaultdict(list)
    for key in client.scan_iter(all_keys(prefix), count=1000):
        match = _UUID.search(key)
        if match and match.group(0) in race_ids:
            found[match.group(0)].append(key)
    return found


def _phase(state: dict[str, Any] | None) -> str | None:
    if state is None:
        return None
    race = state["race"]
    if race.get("finished"):
        return "finished"
    running = [a for a in race.get("attempts", []) if a.get("phase") == "running"]
    return {1: "primary_running", 2: "both_running"}.get(len(running))


def sample(bench: Any, race_ids: list[str], used0: int, want: str) -> dict[str, Any] | None:
    """Bytes per race of the races now in phase ``want`` (None when none is)."""
    client, store = bench.client, bench.store
    in_phase = {r for r in race_ids if _phase(_state(store, r)) == want}
    if not in_phase:
        return None
    used = int(client.info("memory")["used_memory"])
    keys = _race_keys(client, bench.prefix, in_phase)
    pipe = client.pipeline(transaction=False)
    order = [(r, k) for r in sorted(keys) for k in keys[r]]
    for _, key in order:
        pipe.memory_usage(key, samples=0)
    by_kind: dict[str, list[int]] = defaultdict(list)
    per_race: dict[str, int] = defaultdict(int)
    for (race_id, key), size in zip(order, pipe.execute(), strict=True):
        if size is None:
            continue  # expired between the scan and the look
        by_kind[_kind(key, race_id)].append(int(size))
        per_race[race_id] += int(size)
    n = len(in_phase)
    return {
        "races": n,
        "race_keys_bytes_per_race": round(statistics.fmean(per_race.values())) if per_race else 0,
        "by_key_bytes_per_race": {k: round(sum(v) / n) for k, v in sorted(by_kind.items())},
        "used_memory_growth_per_race": round((used - used0) / n),
    }


def _state(store: Any, race_id: str) -> dict[str, Any] | None:
    record = store.load(race_id)
    return None if record is None else record.state


def memory_row(bench: Any, races: int, request_bytes: int, scale: float) -> dict[str, Any]:
    """``races`` races with a ``request_bytes`` request; Redis bytes per race by phase."""
    hedge_s = 3.0  # real seconds: the hedge timer; the primary runs 3x, the hedge 1x that
    sim = {
        "p": {"queue_s": 0, "run_s": 3 * hedge_s / scale},
        "h": {"queue_s": 0, "run_s": hedge_s / scale},
    }
    warm = bench.send({"sim": sim}, policy="hedge:p->h@0.01s")
    warm.get(timeout=60)
    time.sleep(1.0)  # its loser's cancel settles
    used0 = int(bench.client.info("memory")["used_memory"])
    text = "x" * max(0, request_bytes - 100)
    t0 = time.monotonic()
    ids = [
        bench.send({"text": text, "sim": sim}, policy=f"hedge:p->h@{hedge_s}s").id
        for _ in range(races)
    ]
    sent_s = time.monotonic() - t0
    phases: dict[str, Any] = {}
    request_size = 0
    for want, at in (("primary_running", 0.5), ("both_running", 1.5)):
        time.sleep(max(0.0, t0 + at * hedge_s + sent_s - time.monotonic()))
        phases[want] = sample(bench, ids, used0, want)
        request_size = request_size or bench.client.strlen(bench.store.shards.race(ids[0]).request)
    for race_id in ids:
        bench.app.AsyncResult(race_id).get(timeout=60 + 4 * hedge_s)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(bench.store.receipt(r) is None for r in ids):
        time.sleep(0.2)  # the losers' cancels confirmed: every receipt written
    phases["finished"] = sample(bench, ids, used0, "finished")
    return {
        "row": "memory",
        "races": races,
        "request_bytes": request_bytes,
        "request_key_strlen_while_racing": request_size or None,
        "sent_s": round(sent_s, 2),
        "phases": phases,
        "what": "MEMORY USAGE (SAMPLES 0) of every key naming a race, per race, by key kind; "
        "used_memory growth over the baseline / races in the phase (includes shared sets "
        "and broker messages); finished = receipt kept for GPUHEDGE_RECEIPT_TTL_S",
    }
