"""Distributed hedged races: the driver that runs the engine over Redis, receipts, settings.

Public helpers::

    from gpuhedge_celery.race import receipt, load_payload
    receipt(race_id)          # the full receipt (provisional while the race runs), or None
    load_payload(result)      # a hedged_infer result's payload, fetched if it was referenced
"""

from __future__ import annotations

from typing import Any

from .receipt import read_receipt

__all__ = ["load_payload", "receipt"]


def _store(redis_url: str | None, prefix: str | None) -> Any:
    from ..settings import Settings, current
    from ..store.connection import client_for
    from ..store.races import RaceStore

    settings = Settings.from_env(redis_url=redis_url, prefix=prefix)
    shards = current().race_shards(settings.prefix, settings.redis_url)
    return RaceStore(client_for(settings.redis_url), shards)


def receipt(
    race_id: str, *, redis_url: str | None = None, prefix: str | None = None
) -> dict[str, Any] | None:
    """The receipt of race ``race_id`` (= its ``hedged_infer`` task id), None if unknown.

    Redis URL and key prefix default to ``GPUHEDGE_REDIS_URL`` / ``GPUHEDGE_PREFIX``.
    """
    from ..store.connection import translate_errors

    store = _store(redis_url, prefix)
    with translate_errors():
        return read_receipt(store, race_id)


def load_payload(
    result: dict[str, Any], *, redis_url: str | None = None, prefix: str | None = None
) -> Any:
    """The payload of a ``hedged_infer`` result (read from Redis when it carries a reference)."""
    from .receipt import load_payload as _load

    return _load(result, _store(redis_url, prefix).client)
