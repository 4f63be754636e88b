"""The app's Redis result backend: Celery's, except that a race's payload is stored once.

A race's winning payload is already in Redis: the attempt's stored result
(:func:`~gpuhedge_celery.race.receipt.result_key`), written in the step that reported it.
Marking the caller's result with the payload inline would send it to Redis twice more: the
result key and the ``PUBLISH`` that wakes a waiting ``.get()``. So the workers mark the result
with a reference in the payload's place (``race.receipt.by_reference``: the documented form of
a large payload, ``payload_ref`` + ``payload_bytes``, flagged ``payload_inline``), and this
backend puts the payload back on every read (``.get()``, a poll, the pub/sub message,
``get_task_meta``): one ``GET`` on the caller's side, of the race store (whose Redis is the
results' own unless the store is a Redis Cluster), and the caller sees the same result as
before, key for key.

``create_app`` installs it for ``redis://`` and ``rediss://`` result backends, and
:class:`RaceSentinelBackend` for ``sentinel://`` ones, through the loader's backend aliases (the
configured URL stays as it is); with any other backend the payload is stored inline, as Celery
would. A Celery app built elsewhere (an existing app that sends ``gpuhedge.hedged_infer`` by
name) reads the stored form: a ``payload_ref`` that ``gpuhedge_celery.load_payload`` reads,
unless it uses this backend too
(``result_backend="gpuhedge_celery.tasks.race_backend:RaceRedisBackend+redis://..."``) or the
workers run with ``GPUHEDGE_PAYLOAD_BY_REF=0`` (the payload inline again, stored three times).
A reference whose key has expired (both live for ``GPUHEDGE_RECEIPT_TTL_S``; the result key is
written a moment earlier) reads back as ``payload_ref``, which ``load_payload`` reports as
expired.
"""

from __future__ import annotations

import threading
from typing import Any

from celery import states
from celery.backends.redis import RedisBackend, SentinelBackend
from kombu.utils.encoding import bytes_to_str

from ..race.receipt import PAYLOAD_INLINE, with_payload
from ..store.connection import same_database
from ..store.race_keys import ResultWrite
from .result import payload_client
from .sending import SendingResultConsumer


class RaceRedisBackend(RedisBackend):
    """Celery's Redis result backend; reads put a referenced race payload back."""

    stores_payload_by_reference = True  # read by the race effects (tasks/race_runtime.py)
    ResultConsumer = SendingResultConsumer  # a send to an unreachable Redis fails at once

    _unread = threading.local()  # the task id whose success is stored without reading first

    def mark_won(self, task_id: str, result: Any) -> None:
        """``mark_as_done`` for a race whose winner this process claimed first (one claim per
        race, atomic in Redis): the result is written without Celery's read of the stored
        state before it, which only guards a stored SUCCESS from being overwritten and cannot
        find one here. One round trip instead of two, with Celery's retries kept."""
        self._unread.task_id = task_id
        try:
            self.mark_as_done(task_id, result)
        finally:
            self._unread.task_id = None

    def _store_result(
        self, task_id: Any, result: Any, state: str, traceback: Any = None, **kwargs: Any
    ) -> Any:
        # Celery's store_result passes ``request`` (and any backend extras) by keyword
        if state != states.SUCCESS or getattr(self._unread, "task_id", None) != task_id:
            return super()._store_result(task_id, result, state, traceback, **kwargs)
        meta = self._get_result_meta(
            result=result, state=state, traceback=traceback, request=kwargs.get("request")
        )
        meta["task_id"] = bytes_to_str(task_id)
        self._set_with_state(self.get_key_for_task(task_id), self.encode(meta), state)
        return result

    def won_write(self, task_id: str, result: Any, store_client: Any) -> ResultWrite | None:
        """The write :meth:`mark_won` would make, as data: the same key, encoded value and
        expiry, for the winner claim to set and publish (as :meth:`_set` does) in the round
        trip of the save that declares the winner (``RaceStore.queue_claim_winner``). None
        unless ``store_client`` (the race store's) reaches this backend's Redis database."""
        if not same_database(self.client, store_client):
            return None
        encoded = self.encode_result(result, states.SUCCESS)
        meta = self._get_result_meta(
            result=encoded, state=states.SUCCESS, traceback=None, request=None
        )
        meta["task_id"] = bytes_to_str(task_id)
        expires = self.expires
        return ResultWrite(
            bytes_to_str(self.get_key_for_task(task_id)),
            self.encode(meta),
            int(expires * 1000) if expires else 0,
        )

    def meta_from_decoded(self, meta: dict[str, Any]) -> dict[str, Any]:
        meta = super().meta_from_decoded(meta)
        result = meta.get("result")
        if meta.get("status") == states.SUCCESS and isinstance(result, dict):
            if result.get(PAYLOAD_INLINE) is True and "payload_ref" in result:
                meta["result"] = with_payload(result, payload_client(self.app))
        return meta


class RaceSentinelBackend(SentinelBackend, RaceRedisBackend):
    """:class:`RaceRedisBackend` behind Sentinel: Celery's Sentinel backend finds the primary
    (its connection methods come first), every race read and write above is unchanged."""
