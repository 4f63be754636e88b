"""Remote control: ``gpuhedge_gpus`` asks GPU workers what their GPUs are running right now.

The answer comes from the worker's main process, which knows which requests its child accepted
and has not finished (``celery.worker.state.active_requests``): what the GPU is actually doing,
independent of what Redis believes. A child killed mid-job drops out of that set at once.

    celery -A gpuhedge_celery control gpuhedge_gpus -d gpu0@box   # or: app.control.broadcast(
                                    #   "gpuhedge_gpus", destination=["gpu0@box"], reply=True)

Reply of one worker::

    {"host": "gpu0@box", "gpus": [{"gpu_id": "box:0", "pool": "default",
      "running": [{"task_id": "...", "token": 7, "holder": "...", "since": 1764430000.1}],
      "health": {...} or null}]}

``health`` is the worker's latest NVML reading and what it concluded (``tasks/health.py``), or
null where it does not sample.

A worker that serves no GPU replies ``{"host": ..., "gpus": []}``. The reconcile pass does not
broadcast it to every worker: it names the GPU workers of the lease table as ``destination``
(a GPU worker registers under its node name), so workers of other apps sharing the broker,
which do not know the command, never receive it.
"""

from __future__ import annotations

from typing import Any

from celery.worker import state as worker_state
from celery.worker.control import control_command

from .app import TASK_GPU_RUN, glue_config

COMMAND = "gpuhedge_gpus"


def running_jobs(requests: Any) -> list[dict[str, Any]]:
    """The ``gpu_run`` jobs among a worker's active requests, as reply entries."""
    jobs = []
    for req in list(requests):
        if getattr(req, "name", None) != TASK_GPU_RUN or not getattr(req, "time_start", None):
            continue
        args = list(getattr(req, "args", None) or [])
        kwargs = dict(getattr(req, "kwargs", None) or {})
        lease = kwargs.get("lease") or (args[1] if len(args) > 1 else None)
        if not isinstance(lease, dict) or "token" not in lease:
            continue
        jobs.append(
            {
                "task_id": req.id,
                "token": int(lease["token"]),
                "holder": str(lease.get("holder") or req.id),
                "gpu_id": str(lease.get("gpu_id") or ""),
                "since": float(req.time_start),
            }
        )
    return jobs


def gpu_report(hostname: str, requests: Any) -> dict[str, Any]:
    """This worker's answer: its GPU (if it is a GPU worker) and what runs there."""
    config = glue_config()
    if not config.is_gpu_worker:
        return {"host": hostname, "gpus": []}
    from .health import last_health

    jobs = [j for j in running_jobs(requests) if j["gpu_id"] in ("", config.gpu_id)]
    gpu = {"gpu_id": config.gpu_id, "pool": config.pool, "running": jobs, "health": last_health()}
    return {"host": hostname, "gpus": [gpu]}


@control_command(name=COMMAND)
def gpuhedge_gpus(state: Any) -> dict[str, Any]:
    """Report what each GPU of this worker is running (task id, fencing token, since when)."""
    return gpu_report(state.consumer.hostname, worker_state.active_requests)
