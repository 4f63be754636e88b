"""The webhook receiver: a real uvicorn server on loopback, real Redis, the RunPod fake.

HTTP-level checks use a stub ``apply``; the rest run a real race driver whose RunPod job's
webhook (posted by the fake, in its own process) completes the race through the receiver,
with no poll in between.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from gpuhedge_celery.config import parse_config_text
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.providers.ratelimit import LocalLimiter
from gpuhedge_celery.race.base import RaceParts
from gpuhedge_celery.race.driver import RaceDriver
from gpuhedge_celery.race.settings import RaceSettings
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.webhooks import token as tokens
from gpuhedge_celery.webhooks.app import WebhookApp
from gpuhedge_celery.webhooks.apply import apply_delivery
from gpuhedge_celery.webhooks.settings import WebhookSettings
from tests.support.runpod_fake import KEY, FakeRunpod
from tests.support.webhook_server import Served
from tests.test_races_driver import Recorder, race_stores

pytestmark = pytest.mark.timeout(60)

SECRET = "s3cret-0123456789abcdef"


class Stub:
    def __init__(self, answer=(200, {"applied": "COMPLETED"}), error=None):
        self.calls, self.answer, self.error = [], answer, error

    def __call__(self, race_id, attempt_id, body):
        self.calls.append((race_id, attempt_id, body))
        if self.error:
            raise self.error
        return self.answer


@pytest.fixture
def stub_server():
    stub = Stub()
    served = Served(WebhookApp(WebhookSettings("http://x", SECRET, max_bytes=1000), stub))
    served.stub = stub
    yield served
    served.close()


def url(served, race="r1", attempt="a1", tok=None):
    tok = tok if tok is not None else tokens.token(SECRET, race, attempt)
    return f"{served.url}/hooks/{race}/{attempt}/{tok}"


def test_a_valid_delivery_is_applied_with_any_content_type(stub_server):
    r = httpx.post(url(stub_server), content=b'{"status": "COMPLETED"}',
                   headers={"content-type": "text/plain; charset=latin-1"})  # fmt: skip
    assert r.status_code == 200 and r.json() == {"applied": "COMPLETED"}
    assert stub_server.stub.calls == [("r1", "a1", {"status": "COMPLETED"})]


@pytest.mark.parametrize(
    ("how", "code"),
    [("wrong", 401), ("other-attempt", 401), ("short", 401), ("missing", 404),
     ("non-ascii", 401), ("encoded-slash", 401)],
)  # fmt: skip
def test_a_wrong_or_missing_token_changes_nothing(stub_server, how, code):
    target = {
        "wrong": url(stub_server, tok="0" * 32),
        "other-attempt": url(stub_server, tok=tokens.token(SECRET, "r1", "a2")),
        "short": url(stub_server, tok="abc"),
        "missing": f"{stub_server.url}/r1/a1",
        "non-ascii": url(stub_server, tok="%C3%A9" * 32),
        "encoded-slash": url(stub_server, tok="%2F" * 32),
    }[how]
    r = httpx.post(target, json={"status": "COMPLETED"})
    assert r.status_code == code and "\n" not in r.text and "error" in r.json()
    assert stub_server.stub.calls == []


def test_oversized_bodies_are_refused_declared_or_streamed(stub_server):
    big = b'{"x": "' + b"a" * 2000 + b'"}'
    assert httpx.post(url(stub_server), content=big).status_code == 413

    def chunks():
        for _ in range(20):
            yield b"a" * 100

    assert httpx.post(url(stub_server), content=chunks()).status_code == 413
    assert stub_server.stub.calls == []


@pytest.mark.parametrize("body", [b"", b"   ", b'{"status": ', b"\xff\xfe", b"not json"])
def test_malformed_bodies_get_400_in_one_line(stub_server, body):
    r = httpx.post(url(stub_server), content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "\n" not in r.json()["error"]
    assert stub_server.stub.calls == []


def test_other_methods_and_routes(stub_server):
    assert httpx.get(f"{stub_server.url}/healthz").status_code == 200
    assert httpx.get(url(stub_server)).status_code == 405
    assert httpx.post(f"{stub_server.url}/").status_code == 404


def test_a_failure_to_save_is_503_so_the_provider_may_retry():
    stub = Stub(error=RuntimeError("redis down\nsecond line"))
    served = Served(WebhookApp(WebhookSettings("http://x", SECRET), stub))
    try:
        r = httpx.post(url(served), json={"status": "COMPLETED"})
        assert r.status_code == 503 and r.json() == {"error": "try again"}
    finally:
        served.close()


@pytest.mark.parametrize(
    "base, ok",
    [("https://hooks.example.com/h", True), ("http://127.0.0.1:8088/h", True),
     ("http://localhost:8088/h", True), ("http://[::1]:8088/h", True),
     ("http://hooks.example.com/h", False), ("http://10.0.0.5:8088/h", False)],
)  # fmt: skip
def test_a_plain_http_webhook_url_is_refused_off_loopback(base, ok):
    env = {"GPUHEDGE_WEBHOOK_URL": base, "GPUHEDGE_WEBHOOK_SECRET": SECRET}
    if ok:
        assert WebhookSettings.from_env(env).on
    else:
        with pytest.raises(ConfigError, match="GPUHEDGE_WEBHOOK_URL: expected https://"):
            WebhookSettings.from_env(env)


def test_while_a_secret_is_rotated_out_the_receiver_accepts_tokens_under_both():
    new, old = "n3w-secret-0123456789abcdef", SECRET
    env = {"GPUHEDGE_WEBHOOK_URL": "https://h.example/h", "GPUHEDGE_WEBHOOK_SECRET": new,
           "GPUHEDGE_WEBHOOK_SECRET_PREVIOUS": old}  # fmt: skip
    settings = WebhookSettings.from_env(env)
    assert old not in repr(settings) and new not in repr(settings)
    stub = Stub()
    served = Served(WebhookApp(settings, stub))
    try:
        for secret, code in ((new, 200), (old, 200), ("an0ther-secret-0123456789", 401)):
            tok = tokens.token(secret, "r1", "a1")
            r = httpx.post(f"{served.url}/hooks/r1/a1/{tok}", json={"status": "COMPLETED"})
            assert r.status_code == code, secret
        # workers mint with the current secret only
        assert tokens.context(settings, "r1", "a1")["token"] == tokens.token(new, "r1", "a1")
    finally:
        served.close()
    with pytest.raises(ConfigError, match="GPUHEDGE_WEBHOOK_SECRET_PREVIOUS"):
        WebhookSettings.from_env({**env, "GPUHEDGE_WEBHOOK_SECRET_PREVIOUS": "short"})


def test_settings_refuse_a_url_without_a_secret():
    with pytest.raises(ConfigError, match="GPUHEDGE_WEBHOOK_SECRET"):
        WebhookSettings.from_env(
            {"GPUHEDGE_WEBHOOK_URL": "https://h.example", "GPUHEDGE_WEBHOOK_SECRET": "x"}
        )
    with pytest.raises(ConfigError, match="GPUHEDGE_WEBHOOK_URL"):
        WebhookSettings.from_env(
            {"GPUHEDGE_WEBHOOK_URL": "h.example", "GPUHEDGE_WEBHOOK_SECRET": SECRET}
        )
    assert not WebhookSettings.from_env({}).on
    assert SECRET not in repr(
        WebhookSettings.from_env(
            {"GPUHEDGE_WEBHOOK_URL": "https://h", "GPUHEDGE_WEBHOOK_SECRET": SECRET}
        )
    )


# ------------------------------------------------------------------ through a real race
CONFIG = """
providers:
  rp:
    role: primary
    adapter: runpod
    billed_rate_per_s: 0.0003
    runpod:
      endpoint_id: wh
      api_key: "${{RUNPOD_TEST_KEY}}"
      base_url: "{base}"
      payload: output.audio_base64
      poll: {{min_s: 0.05, max_s: 0.5, fraction: 0.25}}
      cancel_confirm_s: 3
      cancel_poll_s: 0.05
  h:
    role: hedge
    adapter: sim
    sim: {{seed: 2, slow_probability: 0, fast: {{queue_s: 0.05, run_s: 0.3}}}}
policy:
  name: fixed
  params: {{hedge_after_ms: 60000}}
timeouts:
  attempt_cap_s: 60
budget: {{ceiling_usd: 1000}}   # paid adapters need a ceiling (docs/costs.md)
validator: wav
"""


@pytest.fixture(scope="module")
def runpod_fake():
    with FakeRunpod({"api_key": KEY, "webhook_gap_s": 0.2}) as fake:
        yield fake


@pytest.fixture
def race_env(runpod_fake, redis_client, prefix):
    """A driver with webhooks on, its receiver served, and the fake's endpoint ``wh``."""
    runpod_fake.reset()
    cfg = parse_config_text(CONFIG.format(base=runpod_fake.base_url))
    providers = {"rp": cfg.build("rp", env={"RUNPOD_TEST_KEY": KEY}, limiter=LocalLimiter())}
    holder = {}
    app = WebhookApp(WebhookSettings("http://x", SECRET),
                     lambda r, a, b: apply_delivery(holder["driver"], r, a, b))  # fmt: skip
    served = Served(app)
    hooks = WebhookSettings(f"{served.url}/hooks", SECRET, fallback_s=30.0)
    store, timers = race_stores(redis_client, prefix)
    driver = RaceDriver(RaceParts(store, timers, providers.__getitem__, Recorder(), RaceSettings(),
                        webhooks=hooks))  # fmt: skip
    holder["driver"] = driver
    driver.client = redis_client
    driver.cfg, driver.fake, driver.served, driver.app = cfg, runpod_fake, served, app
    yield driver
    served.close()


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def request(run_s=0.2):
    return {"text": "hi", "runpod_fake": {"*": {"queue_s": 0.0, "run_s": run_s}}}


def test_a_webhook_wins_the_race_with_one_status_read_that_verifies_it(race_env):
    d = race_env
    d.create("w1", request(), build_spec(d.cfg), submit_first=True)
    assert wait_for(lambda: d.effects.results)
    assert d.effects.results[0]["winner"] == "rp"
    # the webhook woke the race; RunPod's own /status answer, read once, is what was applied
    assert d.fake.route("wh", "status")["requests"] == 1
    assert d.fake.route("wh", "run")["requests"] == 1
    # the receiver counts its answer after the delivery is applied, so after the race ended
    assert wait_for(lambda: d.app.counts == {200: 1}), d.app.counts
    job = d.fake.job("wh", d.effects.results[0]["job_id"])
    hook = job["options"]["webhook"]
    assert hook.startswith(f"{d.served.url}/hooks/w1/a1/") and SECRET not in hook


def watch_due(d, race_id):
    data = d.client.hgetall(d.timers.of(race_id).keys.data)
    found = [json.loads(v) for v in data.values()]
    return [t["due"] / 1000.0 for t in found
            if t["payload"]["race"] == race_id and t["payload"]["kind"] == "watch"]  # fmt: skip


def test_with_webhooks_on_the_watch_polls_only_as_a_slow_safety_net(race_env):
    d = race_env
    d.create("w6", request(run_s=50), build_spec(d.cfg), submit_first=True)
    (due,) = watch_due(d, "w6")
    # RunPod's pacing alone would look again within 0.5 s (poll.max_s); the fallback is 30 s
    assert due - time.time() > 25


def test_a_retried_delivery_and_one_after_the_finish_are_acknowledged_and_ignored(race_env):
    d = race_env
    d.create("w2", request(), build_spec(d.cfg), submit_first=True)
    assert wait_for(lambda: d.effects.results)
    record = d.store.load("w2")
    job_id = d.effects.results[0]["job_id"]
    body = {
        "id": job_id,
        "status": "COMPLETED",
        "executionTime": 200,
        "output": {"audio_base64": "x"},
    }
    target = f"{d.served.url}/hooks/w2/a1/{tokens.token(SECRET, 'w2', 'a1')}"
    r = httpx.post(target, json=body)
    assert r.status_code == 200 and "ignored" in r.json()
    assert d.store.load("w2").version == record.version and len(d.effects.results) == 1


def test_a_wrong_token_for_a_live_race_changes_nothing(race_env):
    d = race_env
    d.create("w3", request(run_s=5), build_spec(d.cfg), submit_first=True)
    version = d.store.load("w3").version
    r = httpx.post(f"{d.served.url}/hooks/w3/a1/{'f' * 32}", json={"status": "COMPLETED"})
    assert r.status_code == 401
    assert d.store.load("w3").version == version and d.effects.results == []


def test_a_body_that_is_not_a_status_gets_400_and_a_non_terminal_one_is_ignored(race_env):
    d = race_env
    d.create("w4", request(run_s=5), build_spec(d.cfg), submit_first=True)
    target = f"{d.served.url}/hooks/w4/a1/{tokens.token(SECRET, 'w4', 'a1')}"
    version = d.store.load("w4").version
    assert httpx.post(target, json=[1, 2]).status_code == 400
    assert httpx.post(target, json={"status": 7}).status_code == 400
    assert httpx.post(target, json={"status": "IN_PROGRESS"}).status_code == 400  # no id
    job_id = d.store.load("w4").state["race"]["attempts"][0]["job_id"]
    r = httpx.post(target, json={"id": job_id, "status": "IN_PROGRESS"})
    assert r.status_code == 200 and "ignored" in r.json()
    assert d.store.load("w4").version == version


@pytest.mark.parametrize("status", ["COMPLETED", "FAILED", "CANCELLED"])
def test_a_forged_delivery_with_the_attempts_url_changes_nothing(race_env, status):
    """An outsider holding one attempt's URL (from a log, say) posts a terminal status with
    a payload of their own while the real job is still queued: RunPod's /status says it is
    not, so the attempt stays as it was, nothing wins and nothing is confirmed stopped."""
    d = race_env
    race_id = f"forged-{status.lower()}"
    d.create(race_id, request(run_s=30), build_spec(d.cfg), submit_first=True)
    job_id = d.store.load(race_id).state["race"]["attempts"][0]["job_id"]
    before = d.store.load(race_id)
    target = f"{d.served.url}/hooks/{race_id}/a1/{tokens.token(SECRET, race_id, 'a1')}"
    forged = {"id": job_id, "status": status, "executionTime": 1, "delayTime": 1,
              "output": {"audio_base64": "Zm9yZ2Vk"}}  # fmt: skip
    r = httpx.post(target, json=forged)
    assert r.status_code == 200 and "ignored" in r.json(), r.text
    after = d.store.load(race_id)
    assert after.version == before.version and d.effects.results == []
    a1 = after.state["race"]["attempts"][0]
    assert a1["phase"] == "running" and a1.get("receipt") is None
    assert d.fake.job("wh", job_id)["status"] in ("IN_QUEUE", "IN_PROGRESS")


def test_a_failed_job_by_webhook_ends_the_attempt_as_a_poll_would(race_env):
    d = race_env
    d.create("w5", {"text": "x", "runpod_fake": {"*": {"queue_s": 0, "run_s": 0.1,
                                                          "outcome": "FAILED"}}},
             build_spec(d.cfg), submit_first=True)  # fmt: skip
    # the policy moves on at once (the hedge launched), as it does when a poll sees it fail
    assert wait_for(lambda: d.effects.launched == [("w5", "a2")])
    assert d.store.load("w5").state["results"]["a1"]["state"] == "FAILED"
    assert d.fake.route("wh", "status")["requests"] == 1  # the delivery's verifying read


def test_the_command_refuses_to_start_without_a_secret(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUHEDGE_WEBHOOK")}
    argv = [sys.executable, "-m", "gpuhedge_celery", "webhooks", "--port", "1"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "GPUHEDGE_WEBHOOK_SECRET" in line


def test_the_answer_comes_only_after_the_event_is_saved(race_env):
    from tests.support.runpod_fake import default_config

    d = race_env
    d.fake.configure(faults={"webhook": {"drop_next": 1}})  # this test posts the delivery
    d.create("w7", request(run_s=0.2), build_spec(d.cfg), submit_first=True)
    job_id = d.store.load("w7").state["race"]["attempts"][0]["job_id"]
    assert wait_for(lambda: d.fake.job("wh", job_id)["status"] == "COMPLETED")
    body = {"id": job_id, "status": "COMPLETED", "delayTime": 10, "executionTime": 120,
            "output": default_config()["output"]}  # fmt: skip
    target = f"{d.served.url}/hooks/w7/a1/{tokens.token(SECRET, 'w7', 'a1')}"
    r = httpx.post(target, json=body)
    assert r.status_code == 200 and r.json() == {"applied": "COMPLETED"}
    # already in Redis when the answer came: the result, the winner, the receipt
    state = d.store.load("w7").state
    assert state["results"]["a1"]["valid"] is True and state["race"]["winner"] == "a1"
    assert d.store.receipt("w7")["winner"] == "a1"
    assert d.fake.route("wh", "status")["requests"] == 1  # the delivery's verifying read
