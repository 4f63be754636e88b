"""The beat task ``gpuhedge.reconcile``: make Redis agree with what GPU workers really run.

I/O only: take a short lock, send ``gpuhedge_gpus`` to the GPU workers the lease table knows
(by node name, so the workers of other apps sharing the broker never see it) and collect the
replies, read the lease table, let :func:`gpuhedge_celery.core.reconcile.plan` decide, apply its
actions with token-checked store calls, send requests stranded on a dead GPU's queue back
to waiting, and send again pooled requests whose broker message was lost before any worker
took them (``tasks/pooled_sweep.py``). Two passes at once: the second finds the lock held and
skips; even without the lock every action re-checks its premise in Lua, so a repeated pass
changes nothing.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from celery import Celery
from kombu import Queue

from ..core.reconcile import GpuReport, GpuView, LeaseView, RunningJob, plan
from ..metrics import record as metrics
from ..store.availability import set_out
from ..store.leases import LeaseStore
from ..store.pooled import PooledRecords
from .app import (
    QUEUE_POOL,
    TASK_GPU_RUN,
    TASK_POOLED_INFER,
    TASK_RECONCILE,
    app,
    glue_config,
    gpu_queue,
)
from .control import COMMAND
from .pooled_sweep import resend_lost

log = logging.getLogger(__name__)

LOCK_MS = 10_000
RELEASE_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def dead_since_key(store: LeaseStore) -> str:
    """Hash host -> epoch ms when a pass first saw the host without a heartbeat."""
    return store.keys.dead_since()


def gpu_worker_nodes(store: LeaseStore) -> list[str]:
    """Node names of every registered GPU worker (live or not): a GPU worker registers its
    GPU under its Celery node name (``gpu0@box``), so these are the workers to ask."""
    return sorted({gpu.host for gpu in store.gpus(live_only=False) if gpu.host})


def collect_reports(
    celery_app: Celery, timeout_s: float, nodes: list[str] | None = None
) -> dict[str, GpuReport]:
    """Ask GPU workers what their GPUs run; GPU id -> report, for the GPUs that answered.

    ``nodes``: the workers to ask (``destination``). The command is never sent to every
    worker on the broker: a worker of another app sharing it does not know the command and
    logs an error for each pass. No node, no question (an empty destination means "all").
    """
    if nodes is not None and not nodes:
        return {}
    replies = (
        celery_app.control.broadcast(COMMAND, destination=nodes, reply=True, timeout=timeout_s)
        or []
    )
    reports: dict[str, GpuReport] = {}
    for reply in replies:
        for _node, answer in reply.items():
            if not isinstance(answer, dict):
                continue  # an error reply (a worker that does not know the command)
            for gpu in answer.get("gpus") or []:
                jobs = tuple(
                    RunningJob(j["task_id"], int(j["token"]), j.get("holder", ""), j.get("since"))
                    for j in gpu.get("running") or []
                )
                health = gpu.get("health") if isinstance(gpu.get("health"), dict) else None
                reports[gpu["gpu_id"]] = GpuReport(gpu["gpu_id"], jobs, health)
    return reports


def read_views(store: LeaseStore, now_ms: int) -> list[GpuView]:
    """The lease table as the pure rules want it, with how long each dead host has been silent."""
    rows = store.table()
    key = dead_since_key(store)
    with store.guard():
        dead_since = {k: int(v) for k, v in store.client.hgetall(key).items()}
        pipe = store.client.pipeline(transaction=False)
        for host in {r.host for r in rows if not r.host_live and r.host not in dead_since}:
            pipe.hsetnx(key, host, now_ms)
            dead_since[host] = now_ms
        for host in {r.host for r in rows if r.host_live and r.host in dead_since}:
            pipe.hdel(key, host)  # the host came back
        pipe.execute()
    ttls = {pool: store.pool_ttl(pool) for pool in {r.pool for r in rows}}
    views = []
    for r in rows:
        lease = None
        if r.token is not None:
            since = None if r.since_ms is None else r.since_ms / 1000
            lease = LeaseView(r.holder or "", r.token, since, r.ttl_left_ms)
        silent = None
        if not r.host_live and r.host in dead_since:
            silent = max(0.0, (now_ms - dead_since[r.host]) / 1000)
        views.append(
            GpuView(
                r.gpu_id, r.pool, r.host, r.host_live, silent, ttls[r.pool], lease, frozenset(r.out)
            )
        )
    return views


def rescue_stranded(celery_app: Celery, store: LeaseStore, views: list[GpuView]) -> list[str]:
    """Send requests queued for GPUs of dead hosts back to waiting; returns their task ids.

    A GPU worker that died whole leaves its unacknowledged job in the broker, which puts it back
    on that GPU's queue (RabbitMQ when the connection drops, Redis after the visibility
    timeout), where nobody listens while the host is down. Each message is taken through the
    broker's own ``basic_get`` and acknowledged only after it was sent back to waiting, so a
    pass that dies half-way loses nothing. Works on every broker kombu speaks.
    """
    rescued: list[str] = []
    dead = [view for view in views if not view.host_live]
    if not dead:
        return rescued
    with celery_app.connection_for_write() as conn:
        for view in dead:
            with conn.channel() as channel:
                rescued.extend(_rescue_queue(celery_app, conn, channel, view))
    return rescued


def _rescue_queue(celery_app: Celery, conn: Any, channel: Any, view: GpuView) -> list[str]:
    """Drain one dead GPU's queue back to waiting (see :func:`rescue_stranded`)."""
    name = gpu_queue(view.gpu_id)
    queue = Queue(name, channel=channel)
    rescued: list[Any] = []
    while True:
        try:
            message = queue.get(no_ack=False, accept=["json"])
        except conn.channel_errors:
            return rescued  # RabbitMQ: the queue was never declared (404); nothing is stranded
        if message is None:
            return rescued
        try:
            headers = message.headers or {}
            if headers.get("task") != TASK_GPU_RUN:
                raise ValueError(f"unexpected task {headers.get('task')!r}")
            args, kwargs, _embed = message.decode()
            request, lease = (list(args) + [None, None])[:2]
            lease = kwargs.get("lease", lease) or {}
            celery_app.send_task(
                TASK_POOLED_INFER,
                args=(kwargs.get("request", request),),
                kwargs={
                    "pool": lease.get("pool") or view.pool,
                    "attempt": int(kwargs.get("attempt") or 0) + 1,
                    "labels": kwargs.get("labels"),
                },
                task_id=headers["id"],
                queue=QUEUE_POOL,
            )
        except (ValueError, KeyError, TypeError) as e:
            # Not ours to understand: put it back where it was and say so.
            message.reject(requeue=True)
            log.error("left an unreadable message on %s: %s", name, e)
            return rescued
        message.ack()
        rescued.append(headers["id"])


def reconcile_once(
    celery_app: Celery | None = None,
    store: LeaseStore | None = None,
    *,
    timeout_s: float | None = None,
    grace_s: float | None = None,
) -> dict[str, Any]:
    """One reconcile pass; returns what it saw and did (JSON-serialisable)."""
    from .gpu import lease_store

    celery_app = celery_app or app
    config = glue_config(celery_app)
    store = store or lease_store()
    timeout_s = config.control_timeout_s if timeout_s is None else timeout_s
    grace_s = config.reconcile_grace_s if grace_s is None else grace_s
    lock_key, lock_token = store.keys.reconcile_lock(), uuid.uuid4().hex
    lock_ms = max(LOCK_MS, int(timeout_s * 3000))
    with store.guard():
        if not store.client.set(lock_key, lock_token, nx=True, px=lock_ms):
            return {"skipped": "another reconcile pass holds the lock"}
    try:
        reports = collect_reports(celery_app, timeout_s, gpu_worker_nodes(store))
        now = time.time()
        views = read_views(store, int(now * 1000))
        actions = plan(views, reports, now=now, grace_s=grace_s)
        done = []
        for action in actions:
            if action.kind == "free":
                applied = store.force_release(action.gpu_id, action.token)
            elif action.kind == "out":
                set_out(store, action.gpu_id, action.detail["reason"], action.reason)
                applied = True
            elif action.kind == "restore":
                since = action.detail.get("since")
                since_ms = None if since is None else int(since * 1000)
                applied = store.restore(
                    action.gpu_id, action.holder, action.token, since_ms=since_ms
                )
            else:
                applied = False
                metrics.reconcile_corrected(action.kind)  # reported, not applied
                log.warning("reconcile: GPU %s: %s", action.gpu_id, action.reason)
            done.append(
                {
                    "kind": action.kind,
                    "gpu_id": action.gpu_id,
                    "token": action.token,
                    "holder": action.holder,
                    "reason": action.reason,
                    "applied": applied,
                }
            )
            if applied:
                metrics.reconcile_corrected(action.kind)
                log.info(
                    "reconcile: %s GPU %s token %s (%s)",
                    action.kind,
                    action.gpu_id,
                    action.token,
                    action.reason,
                )
        rescued = rescue_stranded(celery_app, store, views)
        resent = resend_lost(celery_app, PooledRecords(store.client, store.keys), leases=store)
        return {
            "gpus": len(views),
            "answered": sorted(reports),
            "actions": done,
            "rescued": rescued,
            "resent": resent,
            "health": {g: r.health for g, r in sorted(reports.items()) if r.health is not None},
        }
    finally:
        with store.guard():
            store.client.eval(RELEASE_LOCK, 1, lock_key, lock_token)


@app.task(name=TASK_RECONCILE, ignore_result=False)
def reconcile() -> dict[str, Any]:
    """Beat task: one reconcile pass (see :func:`reconcile_once`)."""
    return reconcile_once()
