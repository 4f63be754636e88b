"""A caller's bad arguments to ``hedged_infer`` / ``pooled_infer`` on real workers: the caller
gets the one-line error, and the worker logs it as one WARNING line, with no traceback (the
tasks declare these errors expected: ``throws``, ``tasks/signals.py``).

And one size limit for both (``GPUHEDGE_REQUEST_MAX_BYTES``): ``.delay()`` refuses a larger
request before anything is stored or sent, and the worker refuses one sent by name.
"""

from __future__ import annotations

import time
import uuid

import pytest

from gpuhedge_celery.errors import ConfigError, UnknownPool
from gpuhedge_celery.race.settings import RaceSettings
from gpuhedge_celery.tasks.app import QUEUE_COORD, QUEUE_POOL, TASK_POOLED_INFER
from gpuhedge_celery.tasks.pool import pooled_infer
from gpuhedge_celery.tasks.race_runtime import TASK_HEDGED_INFER
from gpuhedge_celery.tasks.races import hedged_infer  # registered before the cluster's app
from tests.support.fixtures_celery import CeleryCluster

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.timeout(180)]

LIMIT = RaceSettings.from_env({}).request_max_bytes  # the workers and this process: the default


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory):
    cluster = CeleryCluster(redis_url, f"args{uuid.uuid4().hex[:8]}",
                            tmp_path_factory.mktemp("args"))  # fmt: skip
    cluster.worker = cluster.start_coordinator()
    yield cluster
    cluster.close()


def refusal_lines(cluster, task_id: str) -> list[str]:
    """The worker's log lines about how ``task_id`` ended (not Celery's "received"), once it
    has logged one."""
    deadline = time.monotonic() + 10
    while True:
        lines = [line for line in cluster.worker.log().splitlines()
                 if task_id in line and f"[{task_id}] received" not in line]  # fmt: skip
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


CASES = [
    (TASK_HEDGED_INFER, ({"text": "hi"},), {"policy": "no-such-policy"}, ConfigError),
    (TASK_HEDGED_INFER, ({"text": "hi"},), {"providers": 7}, ConfigError),
    (TASK_HEDGED_INFER, ({"text": "x" * LIMIT},), {}, ConfigError),
    (TASK_POOLED_INFER, ({"id": 1},), {"pool": "no such pool"}, ConfigError),
    (TASK_POOLED_INFER, ({"id": 1},), {"pool": "p", "timeout_s": "soon"}, ConfigError),
    (TASK_POOLED_INFER, ({"id": 1},), {"pool": "no-such-pool"}, UnknownPool),
    (TASK_POOLED_INFER, ({"text": "x" * LIMIT},), {"pool": "p"}, ConfigError),
]


@pytest.mark.parametrize("name, args, kwargs, error", CASES,
                         ids=lambda v: v if isinstance(v, str) else None)  # fmt: skip
def test_bad_arguments_are_one_warning_line_on_the_worker(cluster, name, args, kwargs, error):
    queue = QUEUE_COORD if name == TASK_HEDGED_INFER else QUEUE_POOL
    # by name, as another app sends it: the worker is the one that refuses it
    result = cluster.app.send_task(name, args, kwargs, queue=queue)
    with pytest.raises(error) as info:
        result.get(timeout=60)
    assert "\n" not in str(info.value)
    lines = refusal_lines(cluster, result.id)
    assert len(lines) == 1, lines
    assert "WARNING" in lines[0] and f"{name}[{result.id}] refused: {info.value}" in lines[0]
    log = cluster.worker.log()
    assert "Traceback" not in log and "raised unexpected" not in log, log[-3000:]


@pytest.mark.parametrize("name", [hedged_infer.name, pooled_infer.name])
def test_delay_refuses_a_request_over_the_limit_before_it_is_sent(cluster, name):
    task = cluster.app.tasks[name]
    queue = QUEUE_COORD if name == TASK_HEDGED_INFER else QUEUE_POOL
    queue_key = f"{cluster.prefix}:{queue}"
    task_id = f"big-{uuid.uuid4().hex}"
    request = {"text": "x" * (5 * 1024 * 1024)}
    kwargs = {"pool": "p"} if name == TASK_POOLED_INFER else {}
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        task.apply_async((request,), kwargs, task_id=task_id)
    assert time.monotonic() - started < 2
    message = str(info.value)
    assert message.startswith("request: ") and "\n" not in message
    assert f"over the {LIMIT:,}-byte limit (GPUHEDGE_REQUEST_MAX_BYTES)" in message
    assert cluster.client.llen(queue_key) == 0  # nothing crossed the broker
    assert not list(cluster.client.scan_iter(f"*{task_id}*"))  # nor was a record written


def test_a_request_at_the_limit_still_goes(cluster):
    """The limit is the same number on both sides: a request of exactly LIMIT bytes passes the
    caller's check and the worker's (refused only for its unknown pool)."""
    import gpuhedge_celery.store.codec as codec

    body = {"text": ""}
    body["text"] = "x" * (LIMIT - codec.size(body))
    assert codec.size(body) == LIMIT
    task = cluster.app.tasks[TASK_POOLED_INFER]
    with pytest.raises(UnknownPool):
        task.delay(body, pool="no-such-pool").get(timeout=60)


@pytest.mark.parametrize("command", ["race", "infer"])
def test_race_and_infer_refuse_a_request_over_the_limit_before_anything_else(
    command, tmp_path, capsys, monkeypatch
):
    import json

    from gpuhedge_celery.cli import EXIT_USAGE, main
    from tests.support.redis_server import free_port

    monkeypatch.chdir(tmp_path)  # the packaged config
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"text": "x" * LIMIT}))
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # refused before Redis is even asked
    assert main(["--redis-url", nowhere, command, f"@{big}", "--go"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: request: ") and "\n" not in err
    assert f"over the {LIMIT:,}-byte limit (GPUHEDGE_REQUEST_MAX_BYTES)" in err


def test_a_workers_own_broken_config_is_not_logged_as_a_callers_mistake(monkeypatch):
    from gpuhedge_celery.errors import GpuHedgeError
    from gpuhedge_celery.tasks import races

    def broken():
        raise ConfigError("cannot import plugin 'gone'", key="GPUHEDGE_PLUGINS")

    monkeypatch.setattr(races, "runtime", broken)
    with pytest.raises(GpuHedgeError) as caught:
        races._worker_runtime()  # noqa: SLF001
    assert not isinstance(caught.value, ConfigError)  # not in hedged_infer's throws
    assert "this worker's configuration is broken" in str(caught.value)
