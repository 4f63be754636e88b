"""A race's end in Redis (mixed into :class:`~.races.RaceStore`): its final receipt, the jobs
shown stopped unregistered with it, its record appended to the record stream, and its keys set
to expire with the receipt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from . import codec
from .codec import dumps_dict, ms
from .race_keys import RECENT_FINISHED, SaveMark, race_keys
from .records import RecordStream
from .scripts import queue_script, run_pipeline
from .timers import store_errors


class RaceReceipts:
    """Receipts and the finish of races."""

    client: Any
    prefix: str
    receipt_ttl_s: float
    live_key: str
    finished_key: str
    records: RecordStream
    _finish: Any
    _finish_on_save: Any

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
        recently finished races (read by :mod:`.race_lookup`).

        ``drop_jobs``: attempts whose jobs reached a terminal state, unregistered by the script
        that writes the receipt (no reader sees them gone beside the receipt before it).
        ``record``: the race's record, appended to the record stream in the same round trip
        (one ``XADD``). Returns how many jobs are still registered as live; with none the race
        also leaves the live index, otherwise it stays there for the janitor (taken out and put
        back with its heartbeat: one more round trip, only then).
        """
        keys = race_keys(self.prefix, race_id)
        data = dumps_dict(receipt, f"receipt of race {race_id!r}")
        ttl_ms = ms(self.receipt_ttl_s if ttl_s is None else ttl_s)
        drop = list(drop_jobs)

        now_ms = self.now_ms()

        def build(pipe: Any) -> None:
            if record is not None:
                self.records.queue_append(pipe, record)
            pipe.delete(keys.request)  # nothing submits once the race is finished
            # the recently finished index (a hint on its own slot, like the heartbeat index)
            pipe.zadd(self.finished_key, {race_id: now_ms})
            pipe.zremrangebyrank(self.finished_key, 0, -RECENT_FINISHED - 1)
            pipe.zremrangebyscore(self.finished_key, "-inf", now_ms - ttl_ms)
            pipe.pexpire(self.finished_key, ttl_ms)
            queue_script(
                pipe, self._finish,
                [keys.receipt, keys.jobs, keys.state, keys.winner, keys.owner_seq],
                [data, ttl_ms, *drop],
            )  # fmt: skip
            # Most races end with no job left registered: leave the live index in this round
            # trip (its own slot, so not in the script), keeping the heartbeat to put back.
            pipe.zscore(self.live_key, race_id)
            pipe.zrem(self.live_key, race_id)

        with store_errors(f"finishing race {race_id!r}"):
            replies = run_pipeline(self.client, build, [self._finish])
            live, heartbeat = int(replies[-3]), replies[-2]
            if live and heartbeat is not None:  # a job still registered: the janitor's to see
                self.client.zadd(self.live_key, {race_id: heartbeat}, gt=True)
        return live

    def queue_finish_on_save(
        self,
        pipe: Any,
        race_id: str,
        receipt: dict[str, Any],
        saved: SaveMark,
        ttl_s: float | None = None,
        *,
        drop_jobs: Iterable[str] = (),
        record: dict[str, Any] | None = None,
    ) -> None:
        """Queue :meth:`finish` on the pipeline of the save whose step finished the race, to
        run only if that save wins (``saved``: its mark): no round trip of its own. Pass
        :attr:`finish_on_save_script` among the save's scripts. The race leaves the live
        index when no job is left registered; a finish sent again after a lost answer
        appends no second record. One script across the race's, the records' and the race
        indexes' slots: a single primary (``docs/architecture.md``, *Redis topology*)."""
        keys = race_keys(self.prefix, race_id)
        data = dumps_dict(receipt, f"receipt of race {race_id!r}")
        ttl_ms = ms(self.receipt_ttl_s if ttl_s is None else ttl_s)
        line = codec.dumps(record) if record is not None and self.records.enabled else ""
        queue_script(
            pipe, self._finish_on_save,
            [keys.receipt, keys.jobs, saved.state_key, keys.request, self.records.key,
             self.finished_key, self.live_key, keys.winner, keys.owner_seq],
            [saved.mark, data, ttl_ms, self.now_ms(), race_id, RECENT_FINISHED, line,
             self.records.maxlen, *drop_jobs],
        )  # fmt: skip

    @property
    def finish_on_save_script(self) -> Any:
        return self._finish_on_save

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
        keys = race_keys(self.prefix, race_id)
        data = dumps_dict(receipt, f"receipt of race {race_id!r}")
        ttl_ms = ms(self.receipt_ttl_s if ttl_s is None else ttl_s)
        with store_errors(f"storing the receipt of race {race_id!r}"):
            if record is None:
                self.client.set(keys.receipt, data, px=ttl_ms)
                return
            pipe = self.client.pipeline(transaction=False)
            pipe.set(keys.receipt, data, px=ttl_ms)
            self.records.queue_append(pipe, record)
            pipe.execute()

    def receipt(self, race_id: str) -> dict[str, Any] | None:
        """The race's receipt, None if it was never written or has expired."""
        with store_errors(f"reading the receipt of race {race_id!r}"):
            found = self.client.get(race_keys(self.prefix, race_id).receipt)
        return None if found is None else codec.loads(found)
