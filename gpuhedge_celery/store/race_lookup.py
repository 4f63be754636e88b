"""Finding races without their full id: recently finished races, and races by id prefix.

``gpuhedge-celery watch --all`` lists recently finished races, and ``gpuhedge-celery receipt``
accepts the shortened ids ``watch`` prints. Both read the two cross-race indexes every race
shard keeps (races in flight: the heartbeat ZSET; recently finished: the ZSET
:meth:`RaceStore.finish` writes), every shard's, and a prefix not found there falls back to a
SCAN of the race keys still in Redis.
"""

from __future__ import annotations

from typing import Any

from .race_keys import check_name, race_key_part, race_keys_pattern
from .timers import as_text, store_errors


def recently_finished(store: Any, limit: int = 100) -> list[tuple[str, int]]:
    """``(race id, finish epoch ms)`` of the most recently finished races over every shard,
    newest first (each shard's newest ``RECENT_FINISHED`` within the receipt TTL; some
    receipts may have expired)."""
    found: list[tuple[str, int]] = []
    with store_errors("reading recently finished races"):
        for index in store.shards.indexes:
            newest = store.client.zrevrange(index.finished, 0, limit - 1, withscores=True)
            found += [(as_text(r), int(score)) for r, score in newest]
    return sorted(found, key=lambda item: item[1], reverse=True)[:limit]


def races_starting_with(store: Any, id_prefix: str, limit: int = 10) -> list[str]:
    """Race ids that start with ``id_prefix`` (at most ``limit``, sorted).

    Races in flight and recently finished first; only when neither index knows a match, any
    race whose state or receipt is still in Redis (a SCAN: slower on a large database).
    ``ValueError`` for a prefix that could never start a race id.
    """
    check_name(id_prefix, "race id prefix")
    pattern = f"{id_prefix}*"
    found: set[str] = set()
    with store_errors(f"looking up races starting with {id_prefix!r}"):
        for index in store.shards.indexes:
            for key in (index.live, index.finished):
                for member, _ in store.client.zscan_iter(key, match=pattern, count=1000):
                    found.add(as_text(member))
        if not found:
            match = race_keys_pattern(store.prefix, id_prefix)
            for raw in store.client.scan_iter(match, count=1000):
                race_id, part = race_key_part(store.prefix, as_text(raw)) or ("", "")
                if race_id.startswith(id_prefix) and part in ("state", "receipt"):
                    found.add(race_id)
                if len(found) > limit:
                    break
    return sorted(found)[:limit]
