"""A race's end in Redis (mixed into :class:`~.races.RaceStore`): its final receipt, the jobs
shown stopped unregistered with it, its record appended to the record stream, and its keys set
to expire with the receipt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from . import codec
from .codec import dumps_dict, ms
from .race_keys import RECENT_FINISHED, RaceShards, SaveMark
from .records import RecordStream
from .round_trip import RoundTrip
from .scripts import queue_script, run_pipeline
from .timers import store_errors


@dataclass(frozen=True)
class Finish:
    """What a race's finish writes: its receipt (kept ``ttl_s``, the store's default when None),
    the attempts whose jobs leave the live-job index with it, and its record (None: none)."""

    receipt: dict[str, Any]
    ttl_s: float | None = None
    drop_jobs: tuple[str, ...] = ()
    record: dict[str, Any] | None = None


class RaceReceipts:
    """Receipts and the finish of races."""

    client: Any
    prefix: str
    receipt_ttl_s: float
    shards: RaceShards
    records: RecordStream
    _finish: Any

    now_ms: Callable[[], int]  # RaceLiveness's

    def finish(
        self,
        race_id: str,
        receipt: dict[str, Any],
        ttl_s: float | None = None,
        *,
        drop_jobs: Iterable[str] = (),
        record: dict[str, Any] | None = None,
    ) -> int:
        """Store the final receipt and let the race's keys expire with it after ``ttl_s``; the
        request (only needed to submit) is dropped at once, and the race joins the index of
        recently finished races (read by :mod:`.race_lookup`). One script, one round trip
        (``race_finish.lua``); a step that finishes its race sends it in its save instead
        (:meth:`ride_finish`).

        ``drop_jobs``: attempts whose jobs reached a terminal state, unregistered by the script
        that writes the receipt (no reader sees them gone beside the receipt before it).
        ``record``: the race's record, appended to the record stream by the same script.
        Returns how many jobs are still registered as live; with none the race also leaves the
        live index, otherwise it stays there for the janitor.
        """
        done = Finish(receipt, ttl_s, tuple(drop_jobs), record)
        with store_errors(f"finishing race {race_id!r}"):
            (reply,) = run_pipeline(
                self.client,
                lambda pipe: self._queue_finish(pipe, race_id, done, ""),
                [self._finish],
            )
        return int(reply[1])

    def ride_finish(self, trip: RoundTrip, race_id: str, done: Finish, saved: SaveMark) -> None:
        """Have ``trip`` carry :meth:`finish` in the save whose step finished the race, to run
        only if that save wins (``saved``: its mark): no round trip of its own. A finish sent
        again after a lost answer appends no second record."""
        trip.ride(lambda pipe: self._queue_finish(pipe, race_id, done, saved.mark), [self._finish])

    def _queue_finish(self, pipe: Any, race_id: str, done: Finish, mark: str) -> None:
        """Queue ``race_finish.lua`` (``mark``: '' to finish now, or the save's mark). One
        script on the race's slot: its keys and its shard's indexes and record stream."""
        receipt, ttl_s, drop_jobs, record = done.receipt, done.ttl_s, done.drop_jobs, done.record
        keys = self.shards.race(race_id)
        index = self.shards.index_of(race_id)
        data = dumps_dict(receipt, f"receipt of race {race_id!r}")
        ttl_ms = ms(self.receipt_ttl_s if ttl_s is None else ttl_s)
        line = codec.dumps(record) if record is not None and self.records.enabled else ""
        queue_script(
            pipe,
            self._finish,
            [
                keys.receipt,
                keys.jobs,
                keys.state,
                keys.request,
                index.records,
                index.finished,
                index.live,
                keys.winner,
                keys.owner_seq,
            ],
            [
                mark,
                data,
                ttl_ms,
                self.now_ms(),
                race_id,
                RECENT_FINISHED,
                line,
                self.records.shard_maxlen,
                *drop_jobs,
            ],
        )

    @property
    def finish_script(self) -> Any:
        return self._finish

    def put_receipt(
        self,
        race_id: str,
        receipt: dict[str, Any],
        ttl_s: float | None = None,
        *,
        record: dict[str, Any] | None = None,
    ) -> None:
        """Store (or replace) a race's receipt, kept ``ttl_s`` (default: the store's TTL);
        ``record``: the race's corrected record, appended in the same round trip."""
        keys = self.shards.race(race_id)
        data = dumps_dict(receipt, f"receipt of race {race_id!r}")
        ttl_ms = ms(self.receipt_ttl_s if ttl_s is None else ttl_s)
        with store_errors(f"storing the receipt of race {race_id!r}"):
            if record is None:
                self.client.set(keys.receipt, data, px=ttl_ms)
                return
            pipe = self.client.pipeline(transaction=False)
            pipe.set(keys.receipt, data, px=ttl_ms)
            self.records.queue_append(pipe, race_id, record)
            pipe.execute()

    def receipt(self, race_id: str) -> dict[str, Any] | None:
        """The race's receipt, None if it was never written or has expired."""
        with store_errors(f"reading the receipt of race {race_id!r}"):
            found = self.client.get(self.shards.race(race_id).receipt)
        return None if found is None else codec.loads(found)
