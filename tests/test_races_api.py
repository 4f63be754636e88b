"""The public face of races on real workers: bad input, payload references, receipts from Python
and the CLI, and the task events Flower builds its view from.

The module's workers keep payloads over 1,000 bytes in Redis (``GPUHEDGE_PAYLOAD_INLINE_MAX``),
so the sim's ~43 kB WAV comes back as a reference.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time

import pytest
from click.testing import CliRunner

from gpuhedge_celery.cli import cli
from gpuhedge_celery.core.validators import validate
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.race.settings import RaceSettings
from tests.support.fixtures_races import start_race_cluster, stop_race_cluster
from tests.support.waiting import wait_for, wait_until_subscribed

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.brokers,
    pytest.mark.sentinel,
    pytest.mark.cluster,
]

HEDGE_RESCUE = {"sim": {"p": {"queue_s": 2, "run_s": 100}, "h": {"queue_s": 0.5, "run_s": 4}}}


@pytest.fixture(scope="module")
def api_cluster(redis_url, tmp_path_factory, broker, request):
    from gpuhedge_celery.store.connection import redis_from_url
    from gpuhedge_celery.store.listener import enable_notifications
    from tests.support.fixtures_celery import broker_url_for

    enable_notifications(redis_from_url(redis_url))
    rc = start_race_cluster(
        redis_url, tmp_path_factory.mktemp("races-api"), workers=1,
        broker_url=broker_url_for(broker, request), GPUHEDGE_PAYLOAD_INLINE_MAX="1000",
    )  # fmt: skip
    yield rc
    stop_race_cluster(rc)


@pytest.mark.parametrize(
    ("args", "kwargs", "fragment"),
    [
        (([1, 2],), {}, "request: expected a JSON object (dict), got list"),
        (({},), {"policy": "nope"}, "policy: expected one of"),
        (({},), {"policy": "hedge:p->nowhere@1s"}, "no provider 'nowhere'"),
        (({},), {"policy": "fixed", "providers": ["p", "zzz"]}, "no provider 'zzz'"),
        (({},), {"policy": "fixed", "providers": ["p"]}, "races 2 provider(s), got 1"),
        (({},), {"validator": "nah"}, "unknown validator 'nah'"),
        (({},), {"validator": {"name": "wav", "colour": 1}}, "bad options for validator 'wav'"),
    ],
)
def test_bad_input_fails_at_once_with_a_one_line_config_error(api_cluster, args, kwargs, fragment):
    res = api_cluster.app.send_task("gpuhedge.hedged_infer", args, kwargs, queue="gpuhedge.coord")
    with pytest.raises(ConfigError) as info:
        res.get(timeout=20)
    message = str(info.value)
    assert fragment in message and "\n" not in message
    assert api_cluster.store.load(res.id) is None  # no race was created


def test_a_request_over_the_size_limit_fails_at_once_and_submits_nothing(api_cluster):
    limit = RaceSettings.from_env({}).request_max_bytes  # the workers run with the default
    res = api_cluster.send({"text": "x" * limit})
    with pytest.raises(ConfigError) as info:
        res.get(timeout=30)
    message = str(info.value)
    assert message.startswith("request: ") and "\n" not in message
    assert f"over the {limit:,}-byte limit (GPUHEDGE_REQUEST_MAX_BYTES)" in message
    keys = api_cluster.store.shards.race(res.id)
    assert api_cluster.store.load(res.id) is None  # no race, so no provider was called
    assert not api_cluster.client.exists(keys.request)


def test_a_large_request_is_stored_once_and_dropped_when_the_race_ends(api_cluster):
    limit = RaceSettings.from_env({}).request_max_bytes
    # the primary wins at 60 s only if the hedge (launched at 30 s) got this very request,
    # which makes it fail; a hedge submitted with anything else would win at 35.5 s
    sim = {"p": {"queue_s": 0, "run_s": 60}, "h": {"queue_s": 0, "run_s": 1, "outcome": "failed"}}
    request = {"text": "x" * (limit - 1000), "sim": sim}
    res = api_cluster.send(request)
    keys = api_cluster.store.shards.race(res.id)
    wait_for(lambda: api_cluster.store.load(res.id) is not None, 20, "the race to start")
    size = len(json.dumps(request, separators=(",", ":")))
    assert api_cluster.client.strlen(keys.request) == size  # compact JSON, once
    state_bytes = sum(len(v) for v in api_cluster.client.hgetall(keys.state).values())
    assert state_bytes < size / 20  # not in the state
    assert res.get(timeout=30)["winner"] == "p"
    receipt = api_cluster.receipt(res.id)
    assert [a["state"] for a in receipt["attempts"]] == ["COMPLETED", "FAILED"]
    assert not api_cluster.client.exists(keys.request)  # nothing needs it any more


def test_calling_the_task_in_process_is_refused_with_one_line():
    from gpuhedge_celery import hedged_infer

    with pytest.raises(ConfigError, match="runs on workers"):
        hedged_infer({"text": "hi"})


def test_large_payload_comes_back_as_a_reference(api_cluster):
    from gpuhedge_celery.race import load_payload

    res = api_cluster.send({"sim": {"p": {"queue_s": 0.5, "run_s": 1}}})
    result = res.get(timeout=20)
    assert "payload" not in result and result["payload_bytes"] > 1000
    state_key = api_cluster.store.shards.race(res.id).state  # the race's own keys hold it
    assert result["payload_ref"].startswith(state_key.removesuffix("state"))
    payload = load_payload(result, redis_url=api_cluster.redis_url, prefix=api_cluster.prefix)
    assert validate("wav", payload).ok


def test_receipt_from_python_and_the_cli(api_cluster):
    import gpuhedge_celery

    res = api_cluster.send(HEDGE_RESCUE)
    assert res.get(timeout=20)["winner"] == "h"
    stored = api_cluster.receipt(res.id)
    url, prefix = api_cluster.redis_url, api_cluster.prefix
    assert gpuhedge_celery.receipt(res.id, redis_url=url, prefix=prefix) == stored

    runner = CliRunner()
    base = ["--redis-url", url, "--prefix", prefix, "receipt", res.id]
    out = runner.invoke(cli, [*base, "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == stored
    out = runner.invoke(cli, base)
    assert out.exit_code == 0, out.output
    assert "winner    h (a2)" in out.output and "hedged" in out.output
    assert "cancel: evidence confirmed_terminal, terminal CANCELLED" in out.output


def test_receipt_cli_errors_are_one_line_with_exit_codes(api_cluster):
    script = shutil.which("gpuhedge-celery")
    assert script, "the gpuhedge-celery entry point is not installed"
    env_args = ["--redis-url", api_cluster.redis_url, "--prefix", api_cluster.prefix]
    cases = [
        (env_args + ["receipt", "no-such-race"], 1, "no race 'no-such-race'"),
        (env_args + ["receipt", "bad id"], 2, "invalid race id"),
        (["--redis-url", "redis://127.0.0.1:1/0", "receipt", "x"], 3, "unreachable"),
    ]
    for argv, code, fragment in cases:
        done = subprocess.run([script, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == code, done.stderr
        assert fragment in done.stderr and done.stderr.count("\n") == 1 and not done.stdout


def test_task_events_show_the_race_lifecycle(api_cluster):
    from celery.events.state import State

    app = api_cluster.app
    events: list[dict] = []
    ready = threading.Event()

    def listen() -> None:
        with app.connection_for_read() as conn:
            receiver = app.events.Receiver(conn, handlers={"*": events.append})
            ready.set()
            try:
                for _ in receiver.itercapture(limit=None, timeout=30, wakeup=False):
                    if stop.is_set():
                        break
            except TimeoutError:  # no event for 30 s: the assertions below will say what
                pass

    stop = threading.Event()
    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    assert ready.wait(10)
    wait_until_subscribed(app, events)  # before the race starts
    res = api_cluster.send(HEDGE_RESCUE)
    res.get(timeout=20)
    api_cluster.receipt(res.id)
    deadline = time.monotonic() + 10
    wanted = {"task-queued", "task-running", "task-hedge_launched", "task-won",
              "task-loser_cancelled", "task-succeeded"}  # fmt: skip
    while time.monotonic() < deadline:
        seen = {e["type"] for e in events if e.get("uuid") == res.id}
        if wanted <= seen:
            break
        time.sleep(0.05)
    stop.set()
    with app.events.default_dispatcher() as dispatcher:  # wake the listener so it ends now
        dispatcher.send("task-test-wakeup", uuid="wakeup")
    listener.join(10)
    assert not listener.is_alive()
    mine = [e for e in events if e.get("uuid") == res.id]
    assert wanted <= {e["type"] for e in mine}, [e["type"] for e in mine]
    won = next(e for e in mine if e["type"] == "task-won")
    assert won["provider"] == "h" and won["race_id"] == res.id and won["role"] == "hedge"
    # celery's own event state (what Flower keeps) turns custom events into task states
    state = State()
    states = []
    for event in mine:
        state.event(event)
        states.append(state.tasks[res.id].state)
    assert "WON" in states and "HEDGE_LAUNCHED" in states
