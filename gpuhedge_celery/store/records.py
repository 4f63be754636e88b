"""The race-record stream: one compact JSON record per finished race, capped, in Redis.

Every finished race appends its record (:mod:`gpuhedge_celery.core.records`) with ``XADD
... MAXLEN ~ N`` with the race's final write (the receipt), so a record never costs a round trip
of its own: the finish script (``race_finish.lua``) appends it, riding in the save of the step
that finished the race, or on its own for a finish outside a step (a resume, the janitor). That
script needs a single primary: the stream lives on its own slot, ``{records}``.
:meth:`RecordStream.queue_append` appends alongside a receipt rewritten later. ``MAXLEN ~``
trims whole stream nodes, so the stream may hold a little more than ``N`` entries; ``N = 0``
turns records off.

Entry ids are Redis's own ``<ms>-<seq>``: the time the race finished on the Redis server's
clock. :meth:`RecordStream.read` pages through a time window with ``XRANGE``.
``gpuhedge-celery records export`` writes them as JSONL that outlives the stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from . import codec
from .race_keys import records_key
from .timers import as_text, store_errors

DEFAULT_RECORDS_MAXLEN = 100_000
FIELD = "r"  # each entry is {"r": <the record as compact JSON>}


class RecordStream:
    """The capped stream of race records under ``prefix``."""

    def __init__(self, client: Any, prefix: str, maxlen: int = DEFAULT_RECORDS_MAXLEN):
        if maxlen < 0:
            raise ValueError(f"maxlen must be >= 0 (0 turns records off), got {maxlen}")
        self.client = client
        self.prefix = prefix
        self.maxlen = maxlen
        self.key = records_key(prefix)

    @property
    def enabled(self) -> bool:
        return self.maxlen > 0

    def queue_append(self, pipe: Any, record: dict[str, Any]) -> None:
        """Queue the ``XADD`` of ``record`` on ``pipe`` (nothing when records are off)."""
        if self.enabled:
            pipe.xadd(self.key, {FIELD: codec.dumps(record)}, maxlen=self.maxlen, approximate=True)

    def append(self, record: dict[str, Any]) -> None:
        """Append one record in a round trip of its own (tests, tools)."""
        if self.enabled:
            with store_errors("appending a race record"):
                pipe = self.client.pipeline(transaction=False)
                self.queue_append(pipe, record)
                pipe.execute()

    def length(self) -> int:
        with store_errors("reading the length of the race-record stream"):
            return int(self.client.xlen(self.key))

    def read(
        self, since_ms: int | None = None, until_ms: int | None = None, *, page: int = 1000
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """``(entry id, record)`` of every entry from ``since_ms`` to ``until_ms`` (epoch ms,
        both inclusive; None: open), oldest first, ``page`` entries per round trip."""
        start = "-" if since_ms is None else str(max(0, int(since_ms)))
        end = "+" if until_ms is None else str(int(until_ms))
        while True:
            with store_errors("reading race records"):
                entries = self.client.xrange(self.key, min=start, max=end, count=page)
            for entry_id, fields in entries:
                raw = fields.get(FIELD, fields.get(FIELD.encode()))
                if raw is None:
                    continue  # not written by this package: nothing to export
                yield as_text(entry_id), codec.loads(raw)
            if len(entries) < page:
                return
            start = "(" + as_text(entries[-1][0])  # exclusive: after the last one read
