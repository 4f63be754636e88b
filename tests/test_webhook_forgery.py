"""What an outsider holding one attempt's webhook URL can do to a RunPod race: nothing.

A real race driver, the real receiver (uvicorn on loopback), real Redis and the RunPod fake in
its own process (the fixtures of ``tests/test_webhooks_receiver.py``). Each test posts a
delivery the fake did not send:

* after the real job completed (its own delivery dropped), a forged COMPLETED carrying a
  well-formed WAV of its own: the race is won with RunPod's payload, read from ``/status``;
* a body naming another, genuinely completed job: refused, the attempt untouched;
* a delivery RunPod cannot be asked about now (its ``/status`` failing): 503 with "try again"
  and nothing of RunPod's answer, the attempt untouched; the retry, once RunPod answers, is
  applied.
"""

from __future__ import annotations

import base64

import httpx
import pytest

from gpuhedge_celery.core.validators import tone_wav
from gpuhedge_celery.race.receipt import load_payload
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.webhooks import token as tokens
from tests.test_webhooks_receiver import SECRET, race_env, request, runpod_fake, wait_for

pytestmark = pytest.mark.timeout(60)

__all__ = ["race_env", "runpod_fake"]  # the fixtures this module uses

REAL = base64.b64encode(tone_wav(1.0, freq_hz=220.0)).decode("ascii")
FORGED = base64.b64encode(tone_wav(1.0, freq_hz=880.0)).decode("ascii")


def hook_url(d, race_id: str, attempt_id: str = "a1") -> str:
    tok = tokens.token(SECRET, race_id, attempt_id)
    return f"{d.served.url}/hooks/{race_id}/{attempt_id}/{tok}"


def job_of(d, race_id: str) -> str:
    return d.store.load(race_id).state["race"]["attempts"][0]["job_id"]


def test_a_forged_completed_after_the_real_end_wins_with_runpods_payload(race_env):
    d = race_env
    d.fake.configure(faults={"webhook": {"drop_next": 1}})  # the real delivery never comes
    fate = {"text": "hi", "runpod_fake": {"*": {"queue_s": 0.0, "run_s": 0.2,
                                               "output": {"audio_base64": REAL}}}}  # fmt: skip
    d.create("fg1", fate, build_spec(d.cfg), submit_first=True)
    job_id = job_of(d, "fg1")
    assert wait_for(lambda: d.fake.job("wh", job_id)["status"] == "COMPLETED")
    forged = {"id": job_id, "status": "COMPLETED", "executionTime": 1, "delayTime": 1,
              "output": {"audio_base64": FORGED}}  # fmt: skip
    r = httpx.post(hook_url(d, "fg1"), json=forged)
    assert r.status_code == 200 and r.json() == {"applied": "COMPLETED"}, r.text
    (won,) = d.effects.results
    assert won["winner"] == "rp"
    assert load_payload(won, d.client) == REAL  # RunPod's own answer, not the body's
    summary = d.store.load("fg1").state["results"]["a1"]
    assert summary["metrics"]["execution_ms"] > 1  # nor the body's figures
    assert d.fake.route("wh", "status")["requests"] == 1  # the delivery's verifying read


def test_a_delivery_naming_another_job_is_refused_and_changes_nothing(race_env):
    d = race_env
    d.create("fg2", request(run_s=30), build_spec(d.cfg), submit_first=True)
    d.create("fg3", request(run_s=0.1), build_spec(d.cfg), submit_first=True)
    other = job_of(d, "fg3")
    assert wait_for(lambda: d.store.load("fg3").state["race"]["winner"] == "a1")
    before = d.store.load("fg2")
    reads = d.fake.route("wh", "status")["requests"]
    genuine = {"id": other, "status": "COMPLETED", "output": {"audio_base64": REAL}}
    r = httpx.post(hook_url(d, "fg2"), json=genuine)
    assert r.status_code == 400 and "not this one" in r.json()["error"], r.text
    after = d.store.load("fg2")
    assert after.version == before.version and after.state["race"]["winner"] is None
    assert d.fake.route("wh", "status")["requests"] == reads  # refused before asking RunPod
    assert [res["race_id"] for res in d.effects.results] == ["fg3"]


def test_a_delivery_runpod_cannot_verify_now_is_503_try_again_then_applied(race_env):
    d = race_env
    d.fake.configure(faults={"webhook": {"drop_next": 1}})
    d.create("fg4", request(run_s=0.1), build_spec(d.cfg), submit_first=True)
    job_id = job_of(d, "fg4")
    assert wait_for(lambda: d.fake.job("wh", job_id)["status"] == "COMPLETED")
    d.fake.configure(faults={"status": {"errors_next": 100, "error_code": 500}})
    before = d.store.load("fg4")
    body = {"id": job_id, "status": "COMPLETED"}
    r = httpx.post(hook_url(d, "fg4"), json=body, timeout=30)
    # only "try again": neither RunPod's status code nor its answer's text
    assert r.status_code == 503
    assert r.json() == {"error": "try again"}
    assert d.store.load("fg4").version == before.version and d.effects.results == []
    d.fake.configure(faults={"status": {}})  # RunPod answers again
    r = httpx.post(hook_url(d, "fg4"), json=body, timeout=30)  # the provider's retry
    assert r.status_code == 200 and r.json() == {"applied": "COMPLETED"}, r.text
    assert [res["winner"] for res in d.effects.results] == ["rp"]
