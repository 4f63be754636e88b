"""A completed attempt's result is validated once and stored once; its verdict travels with it.

The race driver on a real redis-server without Celery (as in test_races_driver.py), with a
validator that counts its calls (the ``wav`` validator underneath).
"""

from __future__ import annotations

import base64

import pytest

from gpuhedge_celery.core import validators as v
from gpuhedge_celery.core.jobs import AttemptResult, JobHandle, JobState
from gpuhedge_celery.race.base import JobRef
from gpuhedge_celery.race.receipt import load_attempt_result, result_key
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.store import codec
from gpuhedge_celery.store.race_keys import RaceShards
from gpuhedge_celery.store.races import RaceStore
from tests.test_races_driver import FAST, Recorder, build_driver

pytestmark = pytest.mark.timeout(60)

CALLS: list[int] = []


@v.validator("counted_wav")
def counted_wav(payload, **options):
    CALLS.append(1)
    return v.wav_payload(payload, **options)


@pytest.fixture
def setup(redis_client, prefix):
    CALLS.clear()
    return build_driver(redis_client, prefix, Recorder())


def test_a_winning_result_is_validated_once_and_stored_with_its_verdict(setup):
    driver, effects, cfg, _, providers = setup
    driver.create("v1", FAST, build_spec(cfg, validator="counted_wav"))
    driver.submit_attempt("v1", "a1")  # submits, polls at once: terminal, concluded inline
    assert len(CALLS) == 1
    [result] = effects.results
    stored = load_attempt_result(driver.store.client, RaceShards(driver.prefix), "v1", "a1")
    assert stored["verdict"]["ok"] is True and stored["verdict"]["reasons"] == []
    assert stored["verdict"]["details"]["duration_s"] == pytest.approx(1.0)
    assert stored["payload_bytes"] == codec.size(stored["payload"])
    assert result["payload"] == stored["payload"]  # the caller's payload is the stored one
    summary = driver.store.load("v1").state["results"]["a1"]
    assert summary["valid"] is True and "payload" not in summary

    # A second watch's answer for the ended attempt: not decoded, not stored again.
    driver.store.client.delete(result_key(RaceShards(driver.prefix), "v1", "a1"))
    handle = JobHandle.from_dict(driver.store.receipt("v1")["attempts"][0]["handle"])
    driver.conclude(JobRef("v1", "a1", "p", handle.to_dict(), 180.0))
    assert len(CALLS) == 1
    assert not driver.store.client.exists(result_key(RaceShards(driver.prefix), "v1", "a1"))
    assert len(effects.results) == 1


def test_an_invalid_result_is_validated_once_and_not_stored(setup):
    driver, effects, cfg, _, _ = setup
    silent = {"sim": {"p": {"queue_s": 0, "run_s": 0, "outcome": "invalid"}}}
    driver.create("v2", silent, build_spec(cfg, policy="single", validator="counted_wav"))
    driver.submit_attempt("v2", "a1")
    assert len(CALLS) == 1
    assert effects.results == [] and len(effects.failures) == 1
    assert not driver.store.client.exists(result_key(RaceShards(driver.prefix), "v2", "a1"))
    summary = driver.store.load("v2").state["results"]["a1"]
    assert summary["valid"] is False and any("near-silent" in r for r in summary["reasons"])


def test_a_step_retried_after_a_version_conflict_does_not_send_the_result_again(setup, monkeypatch):
    driver, effects, cfg, _, providers = setup
    driver.create("v3", {"sim": {"p": {"queue_s": 0, "run_s": 100}}}, build_spec(cfg))
    driver.submit_attempt("v3", "a1")  # running
    handle = JobHandle.from_dict(driver.store.live_jobs("v3")["a1"])
    payload = base64.b64encode(v.tone_wav(1.0)).decode()
    result = AttemptResult("p", handle.job_id, JobState.COMPLETED, 10.0, payload)
    other = RaceStore(driver.store.client, driver.prefix)  # another process
    real_save, queued = driver.store.save, []

    def save(race_id, state, version, trip=None, save_id=None):
        if race_id != "v3" or trip is None:
            return real_save(race_id, state, version, trip, save_id)
        if not queued:  # another process saves the race first: this save conflicts
            record = other.load(race_id)
            other.save(race_id, record.state, record.version)
        ahead = trip.queue_ahead

        def counted(pipe):  # the commands sent ahead of the save: the result's
            n = len(pipe.command_stack)
            ahead(pipe)
            queued.append(len(pipe.command_stack) - n)

        trip.queue_ahead = counted
        return real_save(race_id, state, version, trip, save_id)

    monkeypatch.setattr(driver.store, "save", save)
    driver.conclude(JobRef("v3", "a1", "p", handle.to_dict(), 180.0), None, result)
    assert queued == [1, 0]  # the result rode in the conflicting save only
    assert [r["payload"] for r in effects.results] == [payload]
    stored = load_attempt_result(driver.store.client, RaceShards(driver.prefix), "v3", "a1")
    assert stored["payload"] == payload and stored["verdict"]["ok"] is True
