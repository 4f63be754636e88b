"""The Celery floor of ``bench races``: what a plain Celery task that returns a race's payload
costs on the same broker, workers and client, beside the capacity row.

A race reaches its caller as a Celery task: the caller's ``send_task``, the worker's delivery
and late acknowledgement, and the result written to the backend (``SET`` and ``PUBLISH``) for
the caller. This row sends the same number of tasks of :data:`TASK_NAME` over the same ramp,
each returning the same WAV payload a sim job returns, and finds them done the way the
capacity row finds its races done (the result keys, looked up in batches every 0.5 s). Its CPU
per task (workers, Redis, this client), round trips and Redis bytes per task are the part of
a race's cost that is Celery's own; ``cpu_ms_beyond_floor`` is the rest.

Beside a capacity row the floor's window is as long as that row's (from the first send to the
last look), so both are charged the same seconds of the workers' and Redis's idle work (timer
service, heartbeats, broker polls: docs/benchmarks.md has what it costs). Like the capacity row
it never waits on a result, so it does not subscribe to the results' channels either (Celery's
client does that at each send; nothing would read the payloads published there). Two things a
race does more cheaply than a plain task, which the floor therefore still includes: its broker
acknowledgement rides in the next delivery's round trip (``tasks/broker.py``; a plain task's is
a round trip of its own), and the caller's result refers to the payload stored once instead of
carrying it in its ``SET`` and ``PUBLISH``.

The workers register the task by importing this module as a plugin (``GPUHEDGE_PLUGINS``,
set by the bench's cluster); it runs nowhere else.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from ..names import QUEUE_COORD, TASK_BENCH_CELERY_FLOOR
from ..tasks.app import app
from . import redis_probe
from .race_capacity import _traffic, cpu_snapshot, payload_bytes, still_missing, traffic_fields

Bench = Any  # bench/races.py's Bench

TASK_NAME = TASK_BENCH_CELERY_FLOOR
QUEUE = QUEUE_COORD  # the queue hedged_infer is sent to
SETTLE_S = 1.0


@functools.lru_cache(maxsize=4)
def _payload(seconds: float, sample_rate: int) -> str:
    from ..providers.sim import _audio_b64

    return _audio_b64(seconds, sample_rate, False)


@app.task(name=TASK_NAME, acks_late=True, reject_on_worker_lost=True)
def celery_floor(seconds: float, sample_rate: int) -> dict[str, Any]:
    """The sim's payload for a job of ``seconds`` of audio, built once per process (a sim job
    builds it per result; that work is the race's, not Celery's)."""
    return {"payload": _payload(seconds, sample_rate)}


def floor_row(
    bench: Bench, tasks: int, ramp_s: float, window_s: float | None = None
) -> dict[str, Any]:
    """``tasks`` tasks of :data:`TASK_NAME` over ``ramp_s`` seconds; CPU and traffic per task
    over at least ``window_s`` seconds from the first send (a capacity row's ``wall_s``)."""
    spec = bench.config.build("p").spec
    args = (spec.audio_s, spec.sample_rate)
    bench.app.send_task(TASK_NAME, args, queue=QUEUE).get(timeout=60)  # both sides warm
    time.sleep(SETTLE_S)  # what the row before left running is in neither row's window
    traffic0, cpu0 = _traffic(bench), cpu_snapshot(bench)
    t_start = time.perf_counter()
    ids: list[str] = []
    backend = bench.app.backend
    backend.on_task_call = lambda producer, task_id: None  # no SUBSCRIBE (see above)
    try:
        for i in range(tasks):
            ids.append(bench.app.send_task(TASK_NAME, args, queue=QUEUE).id)
            pause = t_start + ramp_s * (i + 1) / tasks - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
    finally:
        del backend.on_task_call  # the class's own again
    pending = {bench.app.backend.get_key_for_task(task_id) for task_id in ids}
    deadline = time.monotonic() + 120
    while pending and time.monotonic() < deadline:
        pending = still_missing(bench.client, pending, lambda key: key)
        if pending:
            time.sleep(0.5)
    if pending:
        raise RuntimeError(f"celery floor: {len(pending)} of {tasks} tasks stored no result")
    wall = time.perf_counter() - t_start
    if window_s is not None and wall < window_s:
        time.sleep(window_s - wall)
    time.sleep(2 * redis_probe.WRITE_INTERVAL_S)  # the workers' counts up to now, written
    traffic = traffic_fields(traffic0, _traffic(bench), tasks)
    cpu = {k: v - cpu0[k] for k, v in cpu_snapshot(bench).items()}
    return {
        "row": "celery-floor",
        "tasks": tasks,
        "ramp_s": ramp_s,
        "wall_s": round(wall, 2),
        "window_s": round(max(wall, window_s or 0.0), 2),
        "cpu_ms_per_task": round(1000.0 * sum(cpu.values()) / tasks, 2),
        "cpu_ms_per_task_by": {k: round(1000.0 * v / tasks, 2) for k, v in cpu.items()},
        "round_trips_per_task": traffic["round_trips_per_race"],
        "redis_bytes_per_task": traffic["redis_bytes_per_race"],
        "redis_commands_per_task": traffic["redis_commands_per_race"],
        "payload_bytes": payload_bytes(bench, "p"),
        "what": "a plain acks_late Celery task returning the capacity row's payload, sent over "
        "the same ramp to the same workers and found done as the capacity row finds its races: "
        "the part of a race's cost that is Celery's own",
    }


def beside_capacity(floor: dict[str, Any], capacity: dict[str, Any]) -> dict[str, Any]:
    """The capacity row's cost per race against the floor's per task (same cluster and run)."""
    by = capacity["cpu_ms_per_race_by"]
    race_bytes, task_bytes = capacity["redis_bytes_per_race"], floor["redis_bytes_per_task"]
    return {
        "cpu_ms_beyond_floor": round(capacity["cpu_ms_per_race"] - floor["cpu_ms_per_task"], 2),
        "cpu_ms_beyond_floor_by": {
            k: round(by.get(k, 0.0) - v, 2) for k, v in floor["cpu_ms_per_task_by"].items()
        },
        "floor_share_of_race_cpu": round(floor["cpu_ms_per_task"] / capacity["cpu_ms_per_race"], 3),
        "redis_bytes_beyond_floor": race_bytes - task_bytes,
    }
