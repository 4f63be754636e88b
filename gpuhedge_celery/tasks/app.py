"""The Celery app: ``celery -A gpuhedge_celery worker`` and ``beat``, configured from the env.

Worker roles and queues (see docs/gpu-workers.md):

* **coordination** (``gpuhedge.coord``): ``pooled_infer`` waits here for a free GPU, and the beat
  reconcile pass runs here. Waiting blocks a thread, not a CPU, so this role runs the ``threads``
  pool with ``GPUHEDGE_COORD_CONCURRENCY`` threads (one pub/sub connection per process serves all
  its waiters). A plain ``celery -A gpuhedge_celery worker`` is this role and also consumes
  ``gpuhedge.attempts`` (hedged-race attempt tasks).
* **GPU** (``gpuhedge.gpu.<gpu_id>``): set ``GPUHEDGE_GPU`` and the same command becomes the
  worker of one GPU: prefork with exactly one child (CUDA cannot be re-initialised in a forked
  child, so the GPU is only ever touched from that one child), ``CUDA_VISIBLE_DEVICES`` pinned
  to the GPU's index, consuming only its GPU's queue. A host with N GPUs runs N such workers
  (``workers/gpu-host.sh``, or the systemd template ``deploy/systemd/gpuhedge-gpu@.service``).
* **beat**: ``celery -A gpuhedge_celery beat`` schedules ``gpuhedge.reconcile`` every
  ``GPUHEDGE_RECONCILE_INTERVAL_S``; run exactly one.

Messages are JSON only. Pooled tasks are ``acks_late`` + ``reject_on_worker_lost`` with prefetch
1, so a worker killed mid-job gets its message redelivered instead of losing it.
"""

from __future__ import annotations

import importlib.util
import os

from celery import Celery
from kombu import Queue

from .config import GlueConfig

QUEUE_COORD = "gpuhedge.coord"
QUEUE_ATTEMPTS = "gpuhedge.attempts"
GPU_QUEUE_PREFIX = "gpuhedge.gpu."

TASK_POOLED_INFER = "gpuhedge.pooled_infer"
TASK_GPU_RUN = "gpuhedge.gpu_run"
TASK_RECONCILE = "gpuhedge.reconcile"
TASK_JANITOR = "gpuhedge.janitor"

# Task modules a worker must import to know every task; optional ones belong to other features.
TASK_MODULES = [
    "gpuhedge_celery.tasks.pool",
    "gpuhedge_celery.tasks.gpu",
    "gpuhedge_celery.tasks.reconcile",
    "gpuhedge_celery.tasks.control",
    "gpuhedge_celery.tasks.signals",
    "gpuhedge_celery.tasks.cancel",
]
OPTIONAL_TASK_MODULES = ["gpuhedge_celery.tasks.races", "gpuhedge_celery.tasks.janitor"]


def gpu_queue(gpu_id: str) -> str:
    """The queue only the worker of ``gpu_id`` consumes."""
    return f"{GPU_QUEUE_PREFIX}{gpu_id}"


def celery_conf(config: GlueConfig) -> dict[str, object]:
    """The Celery settings for ``config`` (a pure function, so it is testable without a worker)."""
    url = config.settings.redis_url
    transport: dict[str, object] = {
        "visibility_timeout": config.visibility_timeout_s,
        # Sweep for messages of dead workers every restore_interval_s, not every 10 x 10 s.
        "unacked_restore_interval": config.restore_interval_s,
        "unacked_restore_throttle": 1,
        # A worker killed mid-sweep leaves kombu's restore mutex held for its expiry (300 s by
        # default), and no message of any dead worker comes back until then.
        "unacked_mutex_expire": int(min(300.0, max(5.0, config.visibility_timeout_s))),
    }
    results: dict[str, object] = {}
    if config.broker_prefix:
        transport["global_keyprefix"] = config.broker_prefix
        results["global_keyprefix"] = config.broker_prefix
    if config.is_gpu_worker:
        queues = [Queue(gpu_queue(config.gpu_id))]
        pool, concurrency = "prefork", 1
    else:
        queues = [Queue(QUEUE_COORD), Queue(QUEUE_ATTEMPTS)]
        pool, concurrency = "threads", config.coord_concurrency
    conf: dict[str, object] = {
        "broker_url": url,
        "result_backend": url,
        "broker_transport_options": transport,
        "result_backend_transport_options": results,
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_default_queue": QUEUE_COORD,
        "task_queues": queues,
        "task_routes": {
            TASK_POOLED_INFER: {"queue": QUEUE_COORD},
            TASK_RECONCILE: {"queue": QUEUE_COORD},
        },
        "worker_prefetch_multiplier": 1,
        "worker_pool": pool,
        "worker_concurrency": concurrency,
        "worker_hijack_root_logger": False,
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
    conf.update(config.as_celery_conf())
    return conf


def create_app(config: GlueConfig | None = None) -> Celery:
    """Build the gpuhedge Celery app from ``config`` (default: the environment, read once)."""
    config = config or GlueConfig.from_env()
    if config.is_gpu_worker and config.gpu is not None and config.gpu.isdigit():
        # Pin before anything can initialise CUDA; the forked child inherits it.
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", config.gpu)
    celery_app = Celery("gpuhedge_celery")
    celery_app.conf.update(celery_conf(config))
    celery_app.gpuhedge_config = config  # read by tasks and signals; never re-read from env
    return celery_app


def glue_config(celery_app: Celery | None = None) -> GlueConfig:
    """The GlueConfig the (default) app was built with."""
    return (celery_app or app).gpuhedge_config


app = create_app()

for _module in TASK_MODULES:
    importlib.import_module(_module)
for _module in OPTIONAL_TASK_MODULES:
    if importlib.util.find_spec(_module) is not None:
        importlib.import_module(_module)
