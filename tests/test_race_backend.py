"""The app's result backend marks a race's first winner without reading the stored state first.

A real Celery app and result backend on the real Redis; the read is counted on the backend.
"""

from __future__ import annotations

import pytest

from gpuhedge_celery.tasks.app import create_app
from gpuhedge_celery.tasks.config import GlueConfig
from gpuhedge_celery.tasks.race_backend import RaceRedisBackend

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


@pytest.fixture
def backend(redis_url, prefix, monkeypatch):
    app = create_app(GlueConfig.from_env({"GPUHEDGE_REDIS_URL": redis_url,
                                          "GPUHEDGE_PREFIX": prefix}))  # fmt: skip
    found = app.backend
    assert isinstance(found, RaceRedisBackend)
    reads = []
    original = found.get
    monkeypatch.setattr(found, "get", lambda key: reads.append(key) or original(key))
    found.reads = reads
    return found


def test_a_first_win_is_stored_in_one_write_and_reads_back_as_mark_as_done_would(backend):
    result = {"winner": "p", "attempt": "a1", "payload": {"text": "hi"}}
    backend.mark_won("race-1", result)
    assert backend.reads == []  # no read before the write
    backend.mark_as_done("race-2", result)
    assert len(backend.reads) == 1  # Celery's own path reads the stored state first
    won, done = backend.get_task_meta("race-1"), backend.get_task_meta("race-2")
    assert won["status"] == done["status"] == "SUCCESS"
    assert won["result"] == done["result"] == result
    assert sorted(won) == sorted(done) and won["task_id"] == "race-1"


def test_other_writes_still_read_first(backend):
    backend.mark_won("race-3", {"winner": "p", "attempt": "a1"})
    backend.reads.clear()
    backend.mark_as_done("race-3", {"winner": "h"})  # a stored SUCCESS is never overwritten
    assert len(backend.reads) == 1
    assert backend.get_task_meta("race-3")["result"] == {"winner": "p", "attempt": "a1"}
