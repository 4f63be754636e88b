"""``GPUHEDGE_PREFIX`` separates task queues too: with ``GPUHEDGE_BROKER_PREFIX`` unset, a prefix
other than the default prefixes Celery's own keys with ``<prefix>:``; the default prefix, and a
``GPUHEDGE_BROKER_PREFIX`` that is set (even to ""), keep what they always gave."""

from __future__ import annotations

import time
import uuid

import pytest

from gpuhedge_celery.errors import UnknownPool
from gpuhedge_celery.settings import DEFAULT_PREFIX
from gpuhedge_celery.tasks.app import QUEUE_POOL, TASK_POOLED_INFER, celery_conf
from gpuhedge_celery.tasks.config import GlueConfig
from tests.support.fixtures_celery import CeleryCluster


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, ""),
        ({"GPUHEDGE_PREFIX": DEFAULT_PREFIX}, ""),
        ({"GPUHEDGE_PREFIX": "team-a"}, "team-a:"),
        ({"GPUHEDGE_PREFIX": "team-a", "GPUHEDGE_BROKER_PREFIX": ""}, ""),
        ({"GPUHEDGE_PREFIX": "team-a", "GPUHEDGE_BROKER_PREFIX": "x:"}, "x:"),
    ],
)
def test_the_broker_prefix_is_derived_from_the_prefix_unless_set(env, expected):
    config = GlueConfig.from_env(env)
    assert config.broker_prefix == expected
    conf = celery_conf(config)
    assert conf["broker_transport_options"].get("global_keyprefix") == (expected or None)
    assert conf["result_backend_transport_options"].get("global_keyprefix") == (expected or None)
    assert conf["gpuhedge_broker_prefix"] == expected  # what `celery inspect conf` shows


def deployment(redis_url: str, tmp_path, name: str) -> CeleryCluster:
    """A cluster of its own prefix whose workers run with GPUHEDGE_BROKER_PREFIX unset."""
    from gpuhedge_celery.tasks.app import create_app

    (tmp_path / name).mkdir()
    cluster = CeleryCluster(redis_url, f"{name}{uuid.uuid4().hex[:8]}", tmp_path / name)
    cluster.env.pop("GPUHEDGE_BROKER_PREFIX")  # the test clusters set it; a user may not
    cluster.config = GlueConfig.from_env(cluster.env)
    cluster.app = create_app(cluster.config)
    return cluster


@pytest.mark.redis
@pytest.mark.celery
@pytest.mark.timeout(120)
def test_two_prefixes_never_take_each_others_tasks(redis_url, tmp_path):
    a, b = deployment(redis_url, tmp_path, "a"), deployment(redis_url, tmp_path, "b")
    try:
        worker_a = a.start_coordinator(wait=False)
        worker_b = b.start_coordinator(wait=False)
        a.wait_ready(worker_a)
        b.wait_ready(worker_b)
        # refused at once by whichever worker takes them: each refusal names its task id
        sent = [a.app.send_task(TASK_POOLED_INFER, ({"n": n},), {"pool": "no-such-pool"},
                                queue=QUEUE_POOL) for n in range(8)]  # fmt: skip
        for result in sent:
            with pytest.raises(UnknownPool):
                result.get(timeout=30)
        time.sleep(0.5)  # the log lines of the last ones
        log_a, log_b = worker_a.log(), worker_b.log()
        assert all(r.id in log_a for r in sent), log_a[-3000:]
        assert not any(r.id in log_b for r in sent), log_b[-3000:]
    finally:
        a.close()
        b.close()
