"""A race's payload is stored in Redis once; the caller's ``.get()`` still returns it inline.

Real coordination workers (``tests/support/fixtures_races.py``), sim providers returning a 1 s
16 kHz WAV (about 43 KB as base64 JSON).
"""

from __future__ import annotations

import pytest
from celery import Celery

from gpuhedge_celery import settings
from gpuhedge_celery.core.validators import validate
from gpuhedge_celery.race import load_payload
from gpuhedge_celery.race.receipt import PAYLOAD_INLINE, result_key
from gpuhedge_celery.store import codec
from gpuhedge_celery.store.connection import redis_from_url
from gpuhedge_celery.store.race_keys import RaceShards
from gpuhedge_celery.tasks.result import RaceResult

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.brokers,
    pytest.mark.sentinel,
    pytest.mark.cluster,
]

FAST = {"sim": {"p": {"queue_s": 0.2, "run_s": 0.5}}}


def big_values(rc, race_id, results):
    """Keys of the race (and, on ``results``, its Celery result) holding more than 10 KB."""
    found = []
    for client in dict.fromkeys((rc.client, results)):
        for key in client.scan_iter(f"{rc.prefix}*{race_id}*", count=1000):
            if client.type(key) == "string" and client.strlen(key) > 10_000:
                found.append(key)
    return found


@pytest.fixture
def results(race_cluster):
    """A client of the Redis of Celery's results: the store's, or the broker's beside a
    Redis Cluster store."""
    rc = race_cluster
    url = rc.app.gpuhedge_config.results_url
    if url == rc.redis_url:
        yield rc.client
        return
    client = redis_from_url(url, decode_responses=True)
    yield client
    client.close()


def test_the_payload_is_stored_once_and_the_caller_gets_it_inline(
    race_cluster, results, monkeypatch
):
    rc = race_cluster
    res = rc.send(FAST)
    result = res.get(timeout=20)
    assert result["winner"] == "p" and validate("wav", result["payload"]).ok
    assert "payload_ref" not in result and PAYLOAD_INLINE not in result
    stored = codec.loads(rc.client.get(result_key(rc.store.shards, res.id, result["attempt"])))
    assert stored["payload"] == result["payload"]
    # the same result, key for key and in order, through hedged_infer's own AsyncResult
    again = RaceResult(res.id, app=rc.app).get(timeout=20)
    assert list(again.items()) == list(result.items())
    # Celery's result key refers to the stored result instead of holding a second copy
    meta_key = rc.app.backend.get_key_for_task(res.id).decode()
    raw = codec.loads(results.get(meta_key))["result"]
    ref = result_key(rc.store.shards, res.id, result["attempt"])
    assert raw["payload_ref"] == ref and raw[PAYLOAD_INLINE] is True
    assert raw["payload_bytes"] == codec.size(result["payload"])
    assert "payload" not in raw and results.strlen(meta_key) < 2_000
    assert big_values(rc, res.id, results) == [ref]
    # A Celery app built elsewhere (a plain Redis backend) reads the documented reference form
    plain = Celery("elsewhere", backend=rc.app.conf.result_backend)
    plain.conf.result_backend_transport_options = rc.app.conf.result_backend_transport_options
    theirs = plain.AsyncResult(res.id).get(timeout=20)
    assert theirs["payload_ref"] == ref and "payload" not in theirs
    assert load_payload(theirs, redis_url=rc.redis_url, prefix=rc.prefix) == result["payload"]
    # ... and wrapping the id in RaceResult, as send_task users are told to, puts it back inline
    # from the store their settings name
    monkeypatch.setenv("GPUHEDGE_REDIS_URL", rc.redis_url)
    settings.reload()
    wrapped = RaceResult(res.id, app=plain).get(timeout=20)
    assert list(wrapped.items()) == list(result.items())


def test_an_expired_payload_reads_back_as_a_reference(race_cluster):
    rc = race_cluster
    res = rc.send(FAST)
    result = res.get(timeout=20)
    rc.client.delete(result_key(rc.store.shards, res.id, result["attempt"]))
    meta = rc.app.backend.get_task_meta(res.id)
    assert meta["status"] == "SUCCESS"
    late = meta["result"]
    assert "payload" not in late and PAYLOAD_INLINE not in late
    assert late["payload_ref"] == result_key(rc.store.shards, res.id, result["attempt"])
    assert late["payload_bytes"] == codec.size(result["payload"])
    with pytest.raises(LookupError, match="expired"):
        load_payload(late, redis_url=rc.redis_url, prefix=rc.prefix)


class _Backend:
    stores_payload_by_reference = True


def test_the_reference_is_a_setting_and_small_payloads_stay_inline():
    from gpuhedge_celery.race.settings import RaceSettings
    from gpuhedge_celery.tasks.race_runtime import CeleryEffects

    big = {"race_id": "r", "attempt": "a1", "payload": "x" * 5000}
    small = {"race_id": "r", "attempt": "a1", "payload": "x" * 100}
    on = CeleryEffects(RaceSettings(), prefix="p")
    stored = on._to_store(_Backend(), "r", big)
    assert (
        stored["payload_ref"] == result_key(RaceShards("p"), "r", "a1") and "payload" not in stored
    )
    assert on._to_store(_Backend(), "r", small) == small
    assert on._to_store(object(), "r", big) == big  # a backend that cannot read it back
    off = CeleryEffects(RaceSettings.from_env({"GPUHEDGE_PAYLOAD_BY_REF": "0"}), prefix="p")
    assert off._to_store(_Backend(), "r", big) == big
