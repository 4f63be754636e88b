"""What the demo leaves on a real Redis: only its races' receipts, for ``RECEIPT_TTL_S``.

Every key the demo's workers and client write lives under the demo's key prefix (the lease
store, the race store, the sim ledger, and Celery's queues, bindings and results through the
broker prefix), so once the workers have stopped one SCAN of the prefix finds them all, and
one more on Celery's own Redis beside a Redis Cluster store (the broker's, which holds them).
"""

from __future__ import annotations

from typing import Any

from ..store.keys import all_keys
from ..store.race_keys import race_key_part

RECEIPT_TTL_S = 3600  # on a real Redis, how long the demo's receipts stay readable


def clean_up(redis_url: str, prefix: str, celery_url: str) -> dict[str, Any]:
    """Delete every key the demo wrote under ``prefix`` (its workers have stopped) on the store's
    Redis and on ``celery_url`` (the Redis of Celery's queues and results: the store's, or the
    broker's beside a Redis Cluster store), except the races' receipts, which keep (at most)
    their ``RECEIPT_TTL_S``."""
    from ..store.connection import client_for

    deleted, kept = 0, 0
    for url in dict.fromkeys((redis_url, celery_url)):
        gone, receipts = _clean(client_for(url), prefix)
        deleted, kept = deleted + gone, kept + receipts
    return {"deleted": deleted, "receipts_kept": kept, "receipt_ttl_s": RECEIPT_TTL_S}


def _clean(client: Any, prefix: str) -> tuple[int, int]:
    """Keys deleted and receipts kept under ``prefix`` on one Redis."""
    deleted, kept = 0, 0
    batch: list[Any] = []
    for key in client.scan_iter(all_keys(prefix), count=1000):
        name = key.decode() if isinstance(key, bytes) else key
        if (race_key_part(prefix, name) or ("", ""))[1] == "receipt":
            ttl_ms = client.pttl(key)
            if ttl_ms < 0 or ttl_ms > RECEIPT_TTL_S * 1000:
                client.pexpire(key, RECEIPT_TTL_S * 1000)
            kept += 1
            continue
        batch.append(key)
        if len(batch) >= 500:
            deleted += client.delete(*batch)
            batch = []
    if batch:
        deleted += client.delete(*batch)
    return deleted, kept
