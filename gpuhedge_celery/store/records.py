"""The race-record stream: one compact JSON record per finished race, capped, in Redis.

Every finished race appends its record (:mod:`gpuhedge_celery.core.records`) with ``XADD
... MAXLEN ~ N`` with the race's final write (the receipt), so a record never costs a round trip
of its own: the finish script (``race_finish.lua``) appends it, riding in the save of the step
that finished the race, or on its own for a finish outside a step (a resume, the janitor). Each
race shard has a stream of its own on the shard's slot (:class:`~.race_keys.RaceShards`), so
that script stays in the race's slot; readers merge every shard's stream in time order.
:meth:`RecordStream.queue_append` appends alongside a receipt rewritten later. ``MAXLEN ~``
trims whole stream nodes, so the stream may hold a little more than ``N`` entries; ``N = 0``
turns records off. With several shards each stream keeps ``N / shards`` (rounded up).

Entry ids are Redis's own ``<ms>-<seq>``: the time the race finished on the Redis server's
clock (with shards on several primaries, each one's clock). :meth:`RecordStream.read` pages
through a time window with ``XRANGE`` on every shard's stream.
``gpuhedge-celery records export`` writes them as JSONL that outlives the stream.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any

from . import codec
from .race_keys import RaceShards
from .timers import as_text, store_errors

DEFAULT_RECORDS_MAXLEN = 100_000
FIELD = "r"  # each entry is {"r": <the record as compact JSON>}


class RecordStream:
    """The capped streams of race records under ``prefix``, one per race shard (``shards``:
    the store's; default one shard)."""

    def __init__(
        self,
        client: Any,
        prefix: str,
        maxlen: int = DEFAULT_RECORDS_MAXLEN,
        shards: RaceShards | None = None,
    ):
        if maxlen < 0:
            raise ValueError(f"maxlen must be >= 0 (0 turns records off), got {maxlen}")
        self.client = client
        self.prefix = prefix
        self.maxlen = maxlen
        self.shards = shards or RaceShards(prefix)
        # each shard's stream keeps its share, so all of them together hold about ``maxlen``
        self.shard_maxlen = -(-maxlen // self.shards.count)
        if self.shards.prefix != prefix:
            raise ValueError(f"race shards under {self.shards.prefix!r}, records under {prefix!r}")
        self.keys = tuple(index.records for index in self.shards.indexes)

    @property
    def enabled(self) -> bool:
        return self.maxlen > 0

    def key_of(self, race_id: str) -> str:
        """The stream race ``race_id``'s record goes to (on its shard's slot)."""
        return self.shards.index_of(race_id).records

    def queue_append(self, pipe: Any, race_id: str, record: dict[str, Any]) -> None:
        """Queue the ``XADD`` of race ``race_id``'s ``record`` on ``pipe`` (nothing when records
        are off)."""
        if self.enabled:
            pipe.xadd(
                self.key_of(race_id),
                {FIELD: codec.dumps(record)},
                maxlen=self.shard_maxlen,
                approximate=True,
            )

    def append(self, race_id: str, record: dict[str, Any]) -> None:
        """Append one record in a round trip of its own (tests, tools)."""
        if self.enabled:
            with store_errors("appending a race record"):
                pipe = self.client.pipeline(transaction=False)
                self.queue_append(pipe, race_id, record)
                pipe.execute()

    def length(self) -> int:
        """Entries in every shard's stream."""
        with store_errors("reading the length of the race-record streams"):
            return sum(int(self.client.xlen(key)) for key in self.keys)

    def read(
        self, since_ms: int | None = None, until_ms: int | None = None, *, page: int = 1000
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """``(entry id, record)`` of every entry from ``since_ms`` to ``until_ms`` (epoch ms,
        both inclusive; None: open), oldest first across shards, ``page`` entries per round
        trip of each shard."""
        for _key, entry_id, record in self.entries(since_ms, until_ms, page=page):
            yield entry_id, record

    def entries(
        self, since_ms: int | None = None, until_ms: int | None = None, *, page: int = 1000
    ) -> Iterator[tuple[str, str, dict[str, Any]]]:
        """:meth:`read` with the stream each entry is in: ``(stream key, entry id, record)``
        (an entry id alone may repeat on two shards)."""
        streams = [self._read_one(key, since_ms, until_ms, page) for key in self.keys]
        for _order, key, entry_id, record in heapq.merge(*streams, key=lambda e: e[0]):
            yield key, entry_id, record

    def _read_one(
        self, key: str, since_ms: int | None, until_ms: int | None, page: int
    ) -> Iterator[tuple[tuple[int, int], str, str, dict[str, Any]]]:
        """One shard's entries, oldest first, each with its id as numbers (the merge order)."""
        start = "-" if since_ms is None else str(max(0, int(since_ms)))
        end = "+" if until_ms is None else str(int(until_ms))
        while True:
            with store_errors("reading race records"):
                entries = self.client.xrange(key, min=start, max=end, count=page)
            for raw_id, fields in entries:
                raw = fields.get(FIELD, fields.get(FIELD.encode()))
                if raw is None:
                    continue  # not written by this package: nothing to export
                entry_id = as_text(raw_id)
                at, _, seq = entry_id.partition("-")
                yield (int(at), int(seq or 0)), key, entry_id, codec.loads(raw)
            if len(entries) < page:
                return
            start = "(" + as_text(entries[-1][0])  # exclusive: after the last one read
