"""The Celery app: ``celery -A gpuhedge_celery worker`` and ``beat``, configured from the env.

Worker roles and queues (see docs/gpu-workers.md):

* **coordination** (``gpuhedge.coord``, ``gpuhedge.attempts``, ``gpuhedge.pool``): races step
  here, the beat reconcile pass runs here and ``pooled_infer`` (queue ``gpuhedge.pool``) waits
  here for a free GPU. Waiting blocks a thread, not a CPU, so this role runs the ``threads`` pool
  with ``GPUHEDGE_COORD_CONCURRENCY`` threads (one pub/sub connection per process serves all its
  waiters). A plain ``celery -A gpuhedge_celery worker`` is this role. ``GPUHEDGE_COORD_QUEUES``
  narrows what one worker consumes: a deployment with a GPU backlog runs its pooled waits on
  workers of their own (``gpuhedge.pool``), so waiting requests never hold the threads races
  step on.
* **GPU** (``gpuhedge.gpu.<gpu_id>``): set ``GPUHEDGE_GPU`` and the same command becomes the
  worker of one GPU: prefork with exactly one child (CUDA cannot be re-initialised in a forked
  child, so the GPU is only ever touched from that one child), ``CUDA_VISIBLE_DEVICES`` pinned
  to the GPU's index, consuming only its GPU's queue. A host with N GPUs runs N such workers
  (``workers/gpu-host.sh``, or the systemd template ``deploy/systemd/gpuhedge-gpu@.service``).
* **beat**: ``celery -A gpuhedge_celery beat`` schedules ``gpuhedge.reconcile`` every
  ``GPUHEDGE_RECONCILE_INTERVAL_S``; run exactly one.

Messages are JSON only. Pooled tasks are ``acks_late`` + ``reject_on_worker_lost`` with prefetch
1, so a worker killed mid-job gets its message redelivered instead of losing it. The broker is
the Redis of everything else, or RabbitMQ (``GPUHEDGE_BROKER_URL=amqp://...``); results, leases
and races always live in Redis (docs/configuration.md says which combinations are supported).
"""

from __future__ import annotations

import importlib.util
import os
from typing import cast

from celery import Celery
from kombu import Queue

from .. import settings as process_settings
from ..names import GPU_QUEUE_PREFIX as GPU_QUEUE_PREFIX
from ..names import QUEUE_ATTEMPTS as QUEUE_ATTEMPTS
from ..names import (
    QUEUE_COORD,
    QUEUE_POOL,
    TASK_JANITOR,
    TASK_POOLED_INFER,
    TASK_RECONCILE,
    gpu_queue,
)
from ..names import TASK_GPU_RUN as TASK_GPU_RUN
from ..redis_url import celery_ssl_options, celery_transport_options, celery_url, is_sentinel
from .config import GlueConfig
from .message_signing import Signing
from .message_signing import enable as enable_signing

RACE_BACKEND_ALIASES = {
    "redis": "gpuhedge_celery.tasks.race_backend:RaceRedisBackend",
    "rediss": "gpuhedge_celery.tasks.race_backend:RaceRedisBackend",
    "sentinel": "gpuhedge_celery.tasks.race_backend:RaceSentinelBackend",
}

# the worker request of a task that carries a caller's request (tasks/redaction.py)
REDACTED_REQUEST = "gpuhedge_celery.tasks.redaction:RedactedRequest"
BEAT_SCHEDULER = "gpuhedge_celery.tasks.beat:Scheduler"  # makes the schedule file's directory

# Task modules a worker must import to know every task; optional ones belong to other features.
TASK_MODULES = [
    "gpuhedge_celery.tasks.pool",
    "gpuhedge_celery.tasks.gpu",
    "gpuhedge_celery.tasks.reconcile",
    "gpuhedge_celery.tasks.control",
    "gpuhedge_celery.tasks.signals",
    "gpuhedge_celery.tasks.redaction",
    "gpuhedge_celery.tasks.cancel",
    "gpuhedge_celery.tasks.metrics",
]
OPTIONAL_TASK_MODULES = ["gpuhedge_celery.tasks.races", "gpuhedge_celery.tasks.janitor"]


BROKER_SOCKET_TIMEOUT_S = 10  # longer than kombu's 1 s blocking pop, so a quiet queue is no error


def celery_conf(config: GlueConfig) -> dict[str, object]:
    """The Celery settings for ``config`` (a pure function, so it is testable without a worker)."""
    url = config.results_url  # the store's Redis, or the broker's beside a cluster store
    transport: dict[str, object] = {}
    if config.broker_kind == "redis":
        # Redis emulates acknowledgements: a message whose whole worker died comes back only
        # after the visibility timeout. RabbitMQ redelivers it when the connection drops.
        transport = {
            "visibility_timeout": config.visibility_timeout_s,
            # Sweep for messages of dead workers every restore_interval_s, not every 10 x 10 s.
            "unacked_restore_interval": config.restore_interval_s,
            "unacked_restore_throttle": 1,
            # A worker killed mid-sweep leaves kombu's restore mutex held for its expiry (300 s
            # by default), and no message of any dead worker comes back until then.
            "unacked_mutex_expire": int(min(300.0, max(5.0, config.visibility_timeout_s))),
        }
    # behind Sentinel, Celery and kombu take the master's name as a transport option
    transport.update(celery_transport_options(config.broker))
    if is_sentinel(config.broker):
        # a failover can leave a connection to a node that never answers: with kombu's default
        # (no timeout) the worker's consumer waited on it for good instead of reconnecting
        transport.update(socket_timeout=BROKER_SOCKET_TIMEOUT_S, socket_connect_timeout=5)
    results: dict[str, object] = dict(celery_transport_options(url))
    tls = {  # a Sentinel URL's ssl=true: Celery's own switch for TLS to the data nodes
        name: options
        for name, options in (
            ("broker_use_ssl", celery_ssl_options(config.broker)),
            ("redis_backend_use_ssl", celery_ssl_options(url)),
        )
        if options is not None
    }
    if config.broker_prefix:
        if config.broker_kind == "redis":
            transport["global_keyprefix"] = config.broker_prefix
        results["global_keyprefix"] = config.broker_prefix
    if config.is_gpu_worker:
        queues = [Queue(gpu_queue(cast(str, config.gpu_id)))]  # a GPU worker's is set
        pool, concurrency = "prefork", 1
    else:
        queues = [Queue(name) for name in config.coord_queues]
        pool, concurrency = "threads", config.coord_concurrency
    conf: dict[str, object] = {
        "broker_url": celery_url(config.broker),
        "result_backend": celery_url(url),
        "broker_transport_options": transport,
        "result_backend_transport_options": results,
        **tls,
        "broker_connection_retry_on_startup": True,
        # A result stored while Redis is down (an outage, a restart) is retried, not turned into
        # the task's failure with a ConnectionError: about 30 s of retries (full-jitter backoff
        # capped at 1 s), so a worker rides out a restart (tests/test_faults_redis.py).
        "result_backend_always_retry": True,
        "result_backend_max_retries": 60,
        "result_backend_max_sleep_between_retries_ms": 1000,
        # a Redis that drops packets fails each connect in seconds, not the OS's two minutes
        "redis_socket_connect_timeout": 5,
        # A race's result is one of its keys: kept as long as its receipt, not Celery's 1 day
        # (else a short receipt TTL leaves Redis growing by each race's payload).
        "result_expires": max(1, round(process_settings.current().receipt_ttl_s)),
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_default_queue": QUEUE_COORD,
        "task_queues": queues,
        "task_routes": {
            TASK_POOLED_INFER: {"queue": QUEUE_POOL},
            TASK_RECONCILE: {"queue": QUEUE_COORD},
        },
        "worker_prefetch_multiplier": 1,
        "worker_pool": pool,
        "worker_concurrency": concurrency,
        "worker_hijack_root_logger": False,
        # never ./celerybeat-schedule.* in whatever directory beat starts from (tasks/beat.py)
        "beat_schedule_filename": config.beat_schedule,
        "beat_scheduler": BEAT_SCHEDULER,
        "beat_schedule": {
            "gpuhedge-reconcile": {
                "task": TASK_RECONCILE,
                "schedule": config.reconcile_interval_s,
                # A pass older than one period is superseded by the next one.
                "options": {"expires": config.reconcile_interval_s},
            },
            # The race janitor (tasks/janitor.py) shares the reconcile period.
            "gpuhedge-janitor": {
                "task": TASK_JANITOR,
                "schedule": config.reconcile_interval_s,
                "options": {"expires": config.reconcile_interval_s, "queue": QUEUE_COORD},
            },
        },
    }
    if config.broker.lower().startswith(("redis://", "rediss://")):
        # kombu's Redis transport, except that a lost connection no longer stops the worker
        # while it holds unacknowledged messages (tasks/broker.py); TLS (rediss://) included
        conf["broker_transport"] = "gpuhedge_celery.tasks.broker:Transport"
    elif is_sentinel(config.broker):  # the same fix: a failover is such a lost connection
        conf["broker_transport"] = "gpuhedge_celery.tasks.broker:SentinelTransport"
    if config.is_gpu_worker and config.max_tasks_per_child is not None:
        conf["worker_max_tasks_per_child"] = config.max_tasks_per_child  # the child loads again
    if config.is_gpu_worker and config.max_memory_per_child_mb is not None:
        conf["worker_max_memory_per_child"] = config.max_memory_per_child_mb * 1024  # KiB
    conf.update(config.as_celery_conf())
    return conf


REDACTING_AMQP = "gpuhedge_celery.tasks.redaction:RedactingAMQP"  # by name: no import cycle


def create_app(config: GlueConfig | None = None, signing: Signing | None = None) -> Celery:
    """Build the gpuhedge Celery app from ``config`` (default: the environment, read once);
    ``signing`` (default: ``GPUHEDGE_SECURITY_*`` of the environment) signs its messages."""
    config = config or process_settings.current().glue
    if config.is_gpu_worker and config.gpu is not None and config.gpu.isdigit():
        # Pin before anything can initialise CUDA; the forked child inherits it.
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", config.gpu)
    # The task modules import this one, so this one must not import them: the worker and beat
    # import them at start-up (``include``), and ``load_tasks`` does for a client that wants
    # them all; a client importing one task (``from gpuhedge_celery import pooled_infer``)
    # loads only what that task needs, in an order free of cycles.
    # the message factory summarises a caller's request in headers and task-sent events
    celery_app = Celery("gpuhedge_celery", include=task_modules(), amqp=REDACTING_AMQP)
    celery_app.conf.update(celery_conf(config))
    signing = signing or process_settings.current().signing
    if signing is not None:  # tasks and remote control signed, results and events JSON
        celery_app.conf.update(signing.celery_conf())
        enable_signing(celery_app, signing)
    # Redis result backends store a race's payload by reference (tasks/race_backend.py); the
    # aliases are the loader's own (the configured URL is left as it is).
    loader = celery_app.loader
    loader.override_backends = {**loader.override_backends, **RACE_BACKEND_ALIASES}
    celery_app.gpuhedge_config = config  # read by tasks and signals; never re-read from env
    return celery_app


def glue_config(celery_app: Celery | None = None) -> GlueConfig:
    """The GlueConfig the (default) app was built with."""
    return (celery_app or app).gpuhedge_config


def task_modules() -> list[str]:
    """Every task module of this installation (the optional ones where present)."""
    optional = [m for m in OPTIONAL_TASK_MODULES if importlib.util.find_spec(m) is not None]
    return [*TASK_MODULES, *optional]


def load_tasks() -> Celery:
    """Import every task module, so the default app knows every task and control command;
    returns the app. ``gpuhedge_celery.app`` (what ``celery -A gpuhedge_celery`` loads) does
    this; a worker or beat of any app built here imports them itself, from ``include``."""
    from .flower_auth import refuse_bad_basic_auth

    refuse_bad_basic_auth()  # `celery -A gpuhedge_celery flower` with an empty password
    for module in task_modules():
        importlib.import_module(module)
    return app


app = create_app()
