"""``hedged_infer`` names ``budget_key`` and ``arm`` by keyword only: a misspelt keyword is
still refused as Celery refuses one that a task's signature lacks, by ``.delay()`` before
anything is sent, and by the worker for a message sent by name."""

from __future__ import annotations

import uuid

import pytest

from gpuhedge_celery.tasks.app import QUEUE_COORD
from gpuhedge_celery.tasks.race_runtime import TASK_HEDGED_INFER
from gpuhedge_celery.tasks.races import hedged_infer  # registered before the cluster's app
from tests.support.fixtures_celery import CeleryCluster

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

MISSPELT = "hedged_infer() got an unexpected keyword argument 'budget_kye'"


@pytest.fixture
def cluster(redis_url, tmp_path, broker, request):
    from tests.support.fixtures_celery import broker_url_for

    prefix = f"kw{uuid.uuid4().hex[:8]}"
    cluster = CeleryCluster(redis_url, prefix, tmp_path, broker_url_for(broker, request))
    yield cluster
    cluster.close()


def test_delay_refuses_a_misspelt_keyword_before_it_is_sent(cluster):
    task = cluster.app.tasks[hedged_infer.name]
    task_id = f"kw-{uuid.uuid4().hex}"
    with pytest.raises(TypeError) as info:
        task.apply_async(({"text": "hi"},), {"budget_kye": "tenant-a"}, task_id=task_id)
    assert str(info.value) == MISSPELT
    assert cluster.client.llen(f"{cluster.prefix}:{QUEUE_COORD}") == 0  # nothing was sent
    assert not list(cluster.client.scan_iter(f"*{task_id}*"))


@pytest.mark.celery
def test_a_worker_refuses_a_misspelt_keyword_sent_by_name(cluster):
    cluster.start_coordinator()
    result = cluster.app.send_task(
        TASK_HEDGED_INFER, ({"text": "hi"},), {"budget_kye": "tenant-a"}, queue=QUEUE_COORD
    )
    with pytest.raises(TypeError) as info:
        result.get(timeout=60)
    assert str(info.value) == MISSPELT
