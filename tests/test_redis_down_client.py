"""A client whose Redis is down: every send fails within seconds with one clear line.

The ``race`` and ``infer`` commands exit 3 with the one-line error every other command gives;
``hedged_infer.delay()`` and ``pooled_infer.delay()`` from a plain script raise
:class:`StoreUnavailable` instead of Celery's 20 s of retries and its "the Celery application
must be restarted". Once Redis is back the same process sends again, and a caller that was
already waiting in ``.get()`` keeps Celery's own reconnect through the outage.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from gpuhedge_celery.errors import StoreUnavailable
from tests.support.faults import RestartableRedis
from tests.support.redis_server import free_port

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

FAST_S = 5.0  # "within a few seconds"; Celery's own retries took about 20


def closed_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # bound, then closed: nothing listens


def client_env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUHEDGE_")}
    return {**env, "GPUHEDGE_REDIS_URL": url, "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("command", ["race", "infer"])
def test_race_and_infer_exit_3_with_one_line_at_once(command, tmp_path):
    url = closed_url()
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gpuhedge_celery", command, '{"text": "hi"}', "--go"],
        env=client_env(url), cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - started
    assert done.returncode == 3, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: Redis at {url} is unreachable"), lines
    assert done.stdout == ""
    assert took < FAST_S, f"{command} took {took:.1f} s"


SCRIPT = textwrap.dedent(
    """
    import sys, time
    from gpuhedge_celery import {name}
    started = time.monotonic()
    try:
        {name}.delay({{"text": "hi"}}{extra})
    except Exception as e:
        print(type(e).__name__, round(time.monotonic() - started, 2), str(e), sep="|")
    else:
        print("sent")
    """
)


@pytest.mark.parametrize("name, extra", [("hedged_infer", ""), ("pooled_infer", ", pool='p'")])
def test_delay_from_a_script_raises_store_unavailable_at_once(name, extra, tmp_path):
    url = closed_url()
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(name=name, extra=extra)],
        env=client_env(url), cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    kind, took, message = done.stdout.strip().split("|")
    assert kind == "StoreUnavailable", done.stdout
    assert float(took) < FAST_S
    assert message.startswith(f"Redis at {url} is unreachable") and "\n" not in message
    assert done.stderr == "", done.stderr  # nothing logged: no retries, no "must be restarted"


def test_a_send_fails_fast_and_the_next_one_works_once_redis_is_back():
    from gpuhedge_celery.tasks.app import create_app
    from gpuhedge_celery.tasks.config import GlueConfig

    redis = RestartableRedis()
    prefix = f"t{uuid.uuid4().hex[:8]}"
    env = {**client_env(redis.url), "GPUHEDGE_PREFIX": prefix,
           "GPUHEDGE_BROKER_PREFIX": f"{prefix}:"}  # fmt: skip
    app = create_app(GlueConfig.from_env(env))
    try:
        redis.start()
        waiting = app.send_task("gpuhedge.test_nothing", queue="q")  # subscribed to its result
        got: dict[str, object] = {}

        def wait() -> None:
            try:
                got["value"] = waiting.get(timeout=60)
            except Exception as e:  # recorded, asserted below
                got["value"] = e

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        time.sleep(0.3)
        redis.stop()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            app.send_task("gpuhedge.test_nothing", queue="q")
        assert time.monotonic() - started < FAST_S
        assert "unreachable" in str(info.value) and "\n" not in str(info.value)
        redis.start()
        sent = app.send_task("gpuhedge.test_nothing", queue="q")  # same process, no restart
        consumer = app.backend.result_consumer
        assert app.backend.get_key_for_task(sent.id) in consumer.subscribed_to
        # the waiter, subscribed before the outage, still gets its result
        app.backend.mark_as_done(waiting.id, {"ok": 1})
        waiter.join(60)
        assert got.get("value") == {"ok": 1}, got
    finally:
        redis.close()


@pytest.mark.parametrize("name, extra", [("hedged_infer", ""), ("pooled_infer", ", pool='p'")])
def test_a_broker_that_is_down_is_store_unavailable_naming_it(name, extra, redis_url, tmp_path):
    broker = closed_url()
    prefix = f"t{uuid.uuid4().hex[:8]}"
    env = {**client_env(redis_url), "GPUHEDGE_BROKER_URL": broker, "GPUHEDGE_PREFIX": prefix,
           "GPUHEDGE_BROKER_PREFIX": f"{prefix}:", "GPUHEDGE_POOL_DIRECT": "off"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(name=name, extra=extra)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    kind, took, message = done.stdout.strip().split("|")
    assert kind == "StoreUnavailable", done.stdout + done.stderr
    assert float(took) < FAST_S
    assert message.startswith(f"the broker at {broker} is unreachable") and "\n" not in message
