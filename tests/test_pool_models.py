"""A real model in real GPU workers: a PyTorch network kept warm in the worker's child.

``python:tests.support.tiny_model:TinyModel`` on real Celery worker processes:

* warm: the network is loaded once, in the prefork child (after the fork), and serves every job;
* a lease lost between two steps of a job stops it at the next step; the request runs again;
* a model that fails to load keeps its GPU out of the pool: no lease is ever taken on it (its
  fencing counter stays 0) while the load is retried with backoff; once it loads, it serves;
* ``kill -9`` of the child mid-job: the new child loads the model again and the job is
  redelivered and completes;
* recycling (``GPUHEDGE_MAX_TASKS_PER_CHILD``, ``GPUHEDGE_MAX_MEMORY_PER_CHILD_MB``): each new
  child loads the model again, and no lease is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from gpuhedge_celery.core.lease_rules import OUT_RUNNER
from gpuhedge_celery.store.availability import out_reasons
from gpuhedge_celery.tasks.app import TASK_POOLED_INFER
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.slow, pytest.mark.brokers]

REPO = Path(__file__).resolve().parents[1]
MODEL = "python:tests.support.tiny_model:TinyModel"


def events(log: Path, kind: str) -> list[dict]:
    if not log.exists():
        return []
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [e for e in lines if e["event"] == kind]


def start_model_gpu(cluster, log: Path, argv: tuple[str, ...] = (), **extra: str):
    env = {
        "PYTHONPATH": str(REPO),
        "TINY_MODEL_LOG": str(log),
        "GPUHEDGE_RUNNER_RETRY_S": "0.3",
        "GPUHEDGE_RUNNER_RETRY_MAX_S": "1",
        **extra,
    }
    return cluster.start_gpu(0, runner=MODEL, wait=False, argv=argv, **env)


def in_pool(cluster, gpu: str) -> bool:
    return not out_reasons(cluster.store, gpu)


def test_one_load_in_the_child_serves_every_job(celery_cluster, tmp_path):
    c, log = celery_cluster, tmp_path / "model.log"
    gpu = c.gpu_id(0)
    worker = start_model_gpu(c, log)
    c.wait_ready(worker, c.start_coordinator(wait=False))
    results = [
        c.app.send_task(TASK_POOLED_INFER, ({"x": [i % 2, 1.0], "id": i},)) for i in range(6)
    ]
    outs = [r.get(timeout=120)["output"] for r in results]
    (load,) = events(log, "load")
    assert load["pid"] != worker.pid and load["pid"] in worker.children(), "loaded in the child"
    assert {o["load"] for o in outs} == {load["load"]} and {o["pid"] for o in outs} == {load["pid"]}
    assert outs[0]["y"] == outs[2]["y"] != outs[1]["y"], "a real, deterministic network"
    wait_for(lambda: c.store.current(gpu) is None and in_pool(c, gpu), 10, "the GPU free")


def test_the_solo_pool_loads_the_model_once_in_the_worker_itself(celery_cluster, tmp_path):
    """``--pool solo``: no child is forked, so the model loads in the worker's own process,
    keeps the GPU out of the pool until it has, serves every job warm, and the GPU leaves the
    pool when the worker stops."""
    c, log = celery_cluster, tmp_path / "model.log"
    gpu = c.gpu_id(0)
    worker = start_model_gpu(c, log, argv=("--pool", "solo"))
    c.wait_ready(worker, c.start_coordinator(wait=False))
    results = [
        c.app.send_task(TASK_POOLED_INFER, ({"x": [i % 2, 1.0], "id": i},)) for i in range(4)
    ]
    outs = [r.get(timeout=120)["output"] for r in results]
    (load,) = events(log, "load")
    assert load["pid"] == worker.pid and not worker.children(), "loaded in the worker itself"
    assert {o["pid"] for o in outs} == {worker.pid} and {o["load"] for o in outs} == {load["load"]}
    wait_for(lambda: c.store.current(gpu) is None and in_pool(c, gpu), 10, "the GPU free")
    worker.kill(signal.SIGTERM)  # a warm shutdown
    wait_for(lambda: not worker.alive(), 30, "the worker stopped")
    assert gpu not in {g.gpu_id for g in c.store.gpus(live_only=True)}, "its GPU left the pool"
    reasons = out_reasons(c.store, gpu)
    assert "worker stopped" in reasons[OUT_RUNNER]["detail"], reasons  # its model was closed


def test_a_lease_lost_between_steps_stops_the_job(celery_cluster, tmp_path):
    c, log = celery_cluster, tmp_path / "model.log"
    gpu = c.gpu_id(0)
    worker = start_model_gpu(c, log, GPUHEDGE_POOL_TTL_MS="1500")  # renewed every 0.5 s
    c.wait_ready(worker, c.start_coordinator(wait=False))
    request = {"id": "long", "steps": 60, "step_s": 0.05, "log_steps": True}
    result = c.app.send_task(TASK_POOLED_INFER, (request,))
    wait_for(lambda: len(events(log, "step")) >= 3, 60, "the job's first steps")
    lease = c.store.current(gpu)
    assert c.store.force_release(gpu, lease.token)
    intruder = c.store.try_claim(gpu, "intruder", ttl_ms=2000)
    taken_at = time.time()
    assert intruder is not None
    out = result.get(timeout=120)
    assert out["attempt"] == 1 and out["output"]["steps"] == 60 and out["token"] > intruder.token
    steps = [e["step"] for e in events(log, "step")]
    first_run = steps[: steps.index(1, 1)]  # the second run starts again at step 1
    assert len(first_run) < 60, "the first run stopped part-way"
    last = events(log, "step")[len(first_run) - 1]
    # one renewal period (0.5 s) and one step (0.05 s), with room for a loaded machine; the
    # whole job would have run 3 s
    assert last["t"] - taken_at < 1.5, "stopped within one renewal period and one step"
    assert len(events(log, "load")) == 1


def test_a_model_that_fails_to_load_keeps_its_gpu_out(celery_cluster, tmp_path):
    c, log = celery_cluster, tmp_path / "model.log"
    gpu = c.gpu_id(0)
    fail = tmp_path / "weights-missing"
    fail.write_text("")
    worker = start_model_gpu(c, log, TINY_MODEL_FAIL=str(fail))
    c.wait_ready(worker, c.start_coordinator(wait=False))

    def retried():
        detail = (out_reasons(c.store, gpu).get(OUT_RUNNER) or {}).get("detail", "")
        return "(attempt 2): RuntimeError: weights unreadable" in detail and detail

    detail = wait_for(retried, 30, "a second failed load")
    assert "retrying in" in detail
    result = c.app.send_task(TASK_POOLED_INFER, ({"id": "waits"},))
    time.sleep(1.5)
    assert not result.ready() and c.store.queue("default") == [result.id]
    assert c.store.last_token(gpu) == 0, "no lease was ever taken on a GPU that cannot serve"
    (row,) = c.store.table()
    assert row.availability == "out" and "weights unreadable" in row.out[OUT_RUNNER]["detail"]
    fail.unlink()
    out = result.get(timeout=60)
    assert out["output"]["id"] == "waits" and out["attempt"] == 0
    assert c.store.last_token(gpu) == out["token"] and len(events(log, "load")) == 1


def test_kill_9_of_the_child_loads_the_model_again_and_redelivers(celery_cluster, tmp_path):
    c, log = celery_cluster, tmp_path / "model.log"
    worker = start_model_gpu(c, log, GPUHEDGE_POOL_TTL_MS="3000")
    c.wait_ready(worker, c.start_coordinator(wait=False))
    request = {"id": "crash", "steps": 40, "step_s": 0.05, "log_steps": True}
    result = c.app.send_task(TASK_POOLED_INFER, (request,))
    wait_for(lambda: events(log, "step"), 60, "the job to start")
    (first,) = events(log, "load")
    os.kill(first["pid"], signal.SIGKILL)
    out = result.get(timeout=120)
    assert out["attempt"] == 1 and out["output"]["steps"] == 40
    loads = events(log, "load")
    assert len(loads) == 2 and loads[1]["pid"] != first["pid"]
    assert out["output"]["load"] == loads[1]["load"] and worker.alive()


@pytest.mark.parametrize(
    "recycle, jobs, children",
    [
        ({"GPUHEDGE_MAX_TASKS_PER_CHILD": "2"}, 5, [0, 0, 1, 1, 2]),
        ({"GPUHEDGE_MAX_MEMORY_PER_CHILD_MB": "1"}, 3, [0, 1, 2]),  # always over: every job
    ],
)
def test_a_recycled_child_loads_again_and_leaves_no_lease(
    celery_cluster, tmp_path, recycle, jobs, children
):
    c, log = celery_cluster, tmp_path / "model.log"
    gpu = c.gpu_id(0)
    worker = start_model_gpu(c, log, **recycle)
    c.wait_ready(worker, c.start_coordinator(wait=False))
    pids = []
    for i in range(jobs):
        out = c.app.send_task(TASK_POOLED_INFER, ({"id": i},)).get(timeout=120)
        assert out["attempt"] == 0, "a recycle never costs a request an attempt"
        pids.append(out["output"]["pid"])
    order = list(dict.fromkeys(pids))
    assert [order.index(p) for p in pids] == children
    loads = events(log, "load")
    assert [e["pid"] for e in loads] == order, "each child loaded the model once"
    closed = {e["pid"] for e in events(log, "close")}
    assert set(order[:-1]) <= closed, "a recycled child closed its model on the way out"
    wait_for(lambda: c.store.current(gpu) is None and in_pool(c, gpu), 30, "the GPU free")
    assert not c.client.exists(c.store.keys.running(c.store.pool_of(gpu), gpu))


def test_a_job_that_reaches_a_gpu_whose_model_cannot_serve_frees_the_lease(
    celery_cluster, tmp_path
):
    """The window the out-of-pool mark cannot close (a child killed and replaced by one whose
    load fails): the job waits GPUHEDGE_RUNNER_WAIT_S for the model, then frees its lease at
    once and waits for a GPU again, never holding the GPU until its TTL."""
    c, log = celery_cluster, tmp_path / "model.log"
    gpu = c.gpu_id(0)
    fail = tmp_path / "weights-missing"
    fail.write_text("")
    worker = start_model_gpu(
        c, log, TINY_MODEL_FAIL=str(fail), GPUHEDGE_RUNNER_WAIT_S="0.5",
        GPUHEDGE_RUNNER_RETRY_S="3", GPUHEDGE_RUNNER_RETRY_MAX_S="3",
        GPUHEDGE_POOL_TTL_MS="60000",
    )  # fmt: skip
    c.wait_ready(worker, c.start_coordinator(wait=False))

    def failed_once():
        detail = (out_reasons(c.store, gpu).get(OUT_RUNNER) or {}).get("detail", "")
        return "failed (attempt 1)" in detail

    wait_for(failed_once, 30, "the first failed load")  # the next one is 3 s away
    c.store.client.delete(
        c.store.keys.out(c.store.pool_of(gpu), gpu)
    )  # as if the mark had been lost
    result = c.app.send_task(TASK_POOLED_INFER, ({"id": "bounced"},))
    wait_for(lambda: c.store.last_token(gpu) > 0, 10, "the job to take the GPU's lease")
    wait_for(lambda: c.store.current(gpu) is None, 5, "the lease freed, long before its TTL")
    assert not result.ready()
    wait_for(lambda: out_reasons(c.store, gpu), 10, "the next failed load to mark it out again")
    fail.unlink()
    out = result.get(timeout=60)
    assert out["attempt"] == 1 and out["output"]["id"] == "bounced"
