"""The Celery app's configuration: GPUHEDGE_* settings, JSON only, roles, pooled task options."""

from __future__ import annotations

import pytest

from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.tasks.app import (
    QUEUE_ATTEMPTS,
    QUEUE_COORD,
    QUEUE_POOL,
    TASK_POOLED_INFER,
    celery_conf,
    create_app,
    gpu_queue,
)
from gpuhedge_celery.tasks.config import GlueConfig


def test_defaults_from_an_empty_environment():
    config = GlueConfig.from_env({})
    assert config.settings.redis_url == "redis://127.0.0.1:6379/0"
    assert config.visibility_timeout_s == 3600
    assert config.reconcile_interval_s == 30
    assert not config.is_gpu_worker and config.gpu_id is None


def test_gpu_worker_settings():
    config = GlueConfig.from_env(
        {"GPUHEDGE_GPU": "1", "GPUHEDGE_HOST": "box", "GPUHEDGE_POOL": "a100",
         "GPUHEDGE_GPU_LABELS": "model=llama", "GPUHEDGE_RUNNER": "cpu:fixed=0.1"}
    )  # fmt: skip
    assert config.gpu_id == "box:1"
    assert config.pool == "a100" and config.labels == {"model": "llama"}
    assert GlueConfig.from_env({"GPUHEDGE_GPU": "other:7"}).gpu_id == "other:7"


@pytest.mark.parametrize(
    "name, value",
    [
        ("GPUHEDGE_VISIBILITY_TIMEOUT_S", "soon"),
        ("GPUHEDGE_VISIBILITY_TIMEOUT_S", "0"),
        ("GPUHEDGE_RECONCILE_INTERVAL_S", "-5"),
        ("GPUHEDGE_HOST_TTL_MS", "1.5"),
        ("GPUHEDGE_COORD_CONCURRENCY", "0"),
        ("GPUHEDGE_MAX_ATTEMPTS", "x"),
        ("GPUHEDGE_POOL_TTL_MS", "0"),
        ("GPUHEDGE_POOL", "my pool"),
        ("GPUHEDGE_GPU", "0 1"),
        ("GPUHEDGE_GPU_LABELS", "novalue"),
        ("GPUHEDGE_REDIS_URL", "http://x"),
    ],
)
def test_bad_values_name_the_variable(name, value):
    env = {name: value}
    if name != "GPUHEDGE_GPU":
        env["GPUHEDGE_GPU"] = "0"  # so the GPU-only checks run too
    with pytest.raises(ConfigError, match=name):
        GlueConfig.from_env(env)


def test_a_gpu_worker_with_a_bad_runner_fails_at_start_up():
    with pytest.raises(ConfigError, match="runner"):
        GlueConfig.from_env({"GPUHEDGE_GPU": "0", "GPUHEDGE_RUNNER": "tpu"})


def test_json_only_and_prefetch_one():
    conf = celery_conf(GlueConfig.from_env({}))
    assert conf["task_serializer"] == conf["result_serializer"] == "json"
    assert conf["accept_content"] == conf["result_accept_content"] == ["json"]
    assert conf["worker_prefetch_multiplier"] == 1


def test_coordination_role():
    conf = celery_conf(GlueConfig.from_env({"GPUHEDGE_COORD_CONCURRENCY": "5"}))
    assert [q.name for q in conf["task_queues"]] == [QUEUE_COORD, QUEUE_ATTEMPTS, QUEUE_POOL]
    assert conf["worker_pool"] == "threads" and conf["worker_concurrency"] == 5
    assert conf["task_routes"][TASK_POOLED_INFER] == {"queue": QUEUE_POOL}


def test_pooled_waits_can_get_workers_of_their_own():
    waiters = celery_conf(GlueConfig.from_env({"GPUHEDGE_COORD_QUEUES": "gpuhedge.pool"}))
    assert [q.name for q in waiters["task_queues"]] == [QUEUE_POOL]
    races = GlueConfig.from_env({"GPUHEDGE_COORD_QUEUES": " gpuhedge.coord, gpuhedge.attempts "})
    assert races.coord_queues == (QUEUE_COORD, QUEUE_ATTEMPTS)


@pytest.mark.parametrize("value", ["gpuhedge.coord,gpuhedge.gpu.0", ",", "celery"])
def test_an_unknown_coordination_queue_is_one_line_naming_the_variable(value):
    with pytest.raises(ConfigError, match="GPUHEDGE_COORD_QUEUES") as e:
        GlueConfig.from_env({"GPUHEDGE_COORD_QUEUES": value})
    assert "\n" not in str(e.value)


def test_gpu_role_is_one_prefork_child_on_its_own_queue():
    conf = celery_conf(GlueConfig.from_env({"GPUHEDGE_GPU": "2", "GPUHEDGE_HOST": "box"}))
    assert [q.name for q in conf["task_queues"]] == [gpu_queue("box:2")]
    assert conf["worker_pool"] == "prefork" and conf["worker_concurrency"] == 1


def test_broker_options_and_beat_schedule():
    env = {"GPUHEDGE_VISIBILITY_TIMEOUT_S": "20", "GPUHEDGE_BROKER_PREFIX": "x:",
           "GPUHEDGE_RECONCILE_INTERVAL_S": "7"}  # fmt: skip
    conf = celery_conf(GlueConfig.from_env(env))
    assert conf["broker_transport_options"]["visibility_timeout"] == 20
    assert conf["broker_transport_options"]["global_keyprefix"] == "x:"
    assert conf["result_backend_transport_options"]["global_keyprefix"] == "x:"
    assert conf["beat_schedule"]["gpuhedge-reconcile"]["schedule"] == 7
    assert conf["gpuhedge_visibility_timeout_s"] == 20


def test_settings_are_mirrored_without_secrets():
    app = create_app(GlueConfig.from_env({"GPUHEDGE_REDIS_URL": "redis://:hunter2@h:1/0"}))
    mirrored = {k: v for k, v in app.conf.items() if k.startswith("gpuhedge_")}
    assert mirrored and "hunter2" not in repr(mirrored)


def test_pooled_tasks_survive_a_dead_worker():
    from gpuhedge_celery.tasks.gpu import gpu_run
    from gpuhedge_celery.tasks.pool import pooled_infer

    for task in (pooled_infer, gpu_run):
        assert task.acks_late and task.reject_on_worker_lost
    assert pooled_infer.name == "gpuhedge.pooled_infer"
    assert gpu_run.name == "gpuhedge.gpu_run"


def test_package_exposes_the_app_and_task():
    import gpuhedge_celery

    assert gpuhedge_celery.app.main == "gpuhedge_celery"
    assert gpuhedge_celery.pooled_infer.name == "gpuhedge.pooled_infer"


def test_control_report_reads_active_gpu_jobs(monkeypatch):
    from types import SimpleNamespace

    from gpuhedge_celery.tasks import control

    lease = {"gpu_id": "box:0", "pool": "p", "token": 4, "holder": "t1", "ttl_ms": 1000}
    active = [
        SimpleNamespace(name="gpuhedge.gpu_run", id="t1", args=[{}, lease], kwargs={},
                        time_start=123.5),
        SimpleNamespace(name="gpuhedge.gpu_run", id="t2", args=[{}, lease], kwargs={},
                        time_start=None),
        SimpleNamespace(name="other", id="t3", args=[], kwargs={}, time_start=1.0),
    ]  # fmt: skip
    config = GlueConfig.from_env(
        {"GPUHEDGE_GPU": "0", "GPUHEDGE_HOST": "box", "GPUHEDGE_POOL": "p"}
    )
    monkeypatch.setattr(control, "glue_config", lambda: config)
    report = control.gpu_report("w@box", active)
    assert report == {
        "host": "w@box",
        "gpus": [{"gpu_id": "box:0", "pool": "p", "running": [
            {"task_id": "t1", "token": 4, "holder": "t1", "gpu_id": "box:0", "since": 123.5}
        ], "health": None}],
    }  # fmt: skip


def test_rabbitmq_broker_keeps_redis_for_results_and_drops_redis_only_options():
    env = {"GPUHEDGE_REDIS_URL": "redis://r:6379/1", "GPUHEDGE_BROKER_PREFIX": "x:",
           "GPUHEDGE_BROKER_URL": "amqp://u:s3cret@rabbit:5672/gpu"}  # fmt: skip
    config = GlueConfig.from_env(env)
    conf = celery_conf(config)
    assert config.broker_kind == "amqp"
    assert conf["broker_url"] == "amqp://u:s3cret@rabbit:5672/gpu"
    assert conf["result_backend"] == "redis://r:6379/1"
    assert conf["broker_transport_options"] == {}  # visibility timeout etc. are Redis's
    assert conf["result_backend_transport_options"]["global_keyprefix"] == "x:"
    assert "s3cret" not in repr(config.as_celery_conf()) + repr(config)


def test_the_broker_defaults_to_the_redis_of_everything_else():
    config = GlueConfig.from_env({"GPUHEDGE_REDIS_URL": "redis://r:6379/1"})
    assert config.broker_kind == "redis"
    assert celery_conf(config)["broker_url"] == "redis://r:6379/1"


@pytest.mark.parametrize("url", ["kafka://k:9092", "rabbit", "sqs://"])
def test_an_unsupported_broker_url_is_one_line_naming_the_variable(url):
    with pytest.raises(ConfigError, match="GPUHEDGE_BROKER_URL") as info:
        GlueConfig.from_env({"GPUHEDGE_BROKER_URL": url})
    assert "\n" not in str(info.value)
