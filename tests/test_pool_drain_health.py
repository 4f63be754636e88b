"""Draining and GPU health with real GPU workers (Celery processes) on the real Redis.

* ``gpuhedge-celery gpus drain`` while a job runs: the job finishes, the command returns when the
  GPU is idle, a request sent meanwhile takes no lease on the drained GPU until ``undrain``.
* GPU health read by the worker from NVML's answers (replayed from a file the test rewrites):
  memory held by a foreign process keeps the GPU out of the pool and ``leases`` says so, the
  reconcile pass returns the worker's reading, the GPU returns once the process is gone; an ECC
  error drains it while its job finishes, until an operator undrains it.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner

from gpuhedge_celery.cli import cli
from gpuhedge_celery.core.lease_rules import OUT_FAULT, OUT_HEALTH
from gpuhedge_celery.store.availability import out_reasons
from gpuhedge_celery.tasks.app import TASK_POOLED_INFER
from gpuhedge_celery.tasks.reconcile import reconcile_once
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.redis,
    pytest.mark.celery,
    pytest.mark.slow,
    pytest.mark.brokers,
    pytest.mark.cluster,
]

GIB = 1024**3


def cli_run(cluster, *args):
    return CliRunner().invoke(cli, ["--redis-url", cluster.redis_url, "--prefix", cluster.prefix,
                                    *args])  # fmt: skip


def running(cluster, gpu):
    return cluster.client.exists(cluster.store.keys.running(cluster.store.pool_of(gpu), gpu))


def test_drain_lets_the_job_finish_and_takes_no_new_one(celery_cluster):
    c = celery_cluster
    gpu = c.gpu_id(0)
    c.wait_ready(c.start_gpu(0, wait=False), c.start_coordinator(wait=False))
    job = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 1.5, "id": "job"},))
    wait_for(lambda: running(c, gpu), 30, "the job to start")
    started = time.monotonic()
    drained = cli_run(c, "gpus", "drain", gpu)
    assert drained.exit_code == 0, drained.output
    assert job.ready() and job.get()["output"]["echo"]["id"] == "job", "it finished its job"
    assert time.monotonic() - started >= 0.5 and f"drained {gpu}: idle" in drained.output
    token = c.store.last_token(gpu)
    later = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 0, "id": "later"},))
    time.sleep(1.0)
    assert not later.ready() and c.store.last_token(gpu) == token, "no new lease while drained"
    assert "drained: drained by an operator" in cli_run(c, "leases").output
    assert "back in the pool" in cli_run(c, "gpus", "undrain", gpu).output
    assert later.get(timeout=30)["output"]["echo"]["id"] == "later"


def device(processes=(), ecc=0):
    return {
        "name": "NVIDIA L4",
        "uuid": "GPU-test",
        "memory": {"total": 24 * GIB, "used": GIB + sum(m for _, m in processes)},
        "utilization": {"gpu": 7, "memory": 1},
        "compute_processes": [{"pid": p, "usedGpuMemory": m} for p, m in processes],
        "graphics_processes": [],
        "ecc_volatile_uncorrected": ecc,
        "xid_events": [],
    }


def test_health_from_nvml_answers(celery_cluster, tmp_path):
    c = celery_cluster
    gpu = c.gpu_id(0)
    answers = tmp_path / "nvml.json"

    def say(dev):
        tmp = answers.with_suffix(".tmp")
        tmp.write_text(json.dumps({"devices": {"0": dev}}))
        tmp.replace(answers)  # never half a file

    say(device([(999_999, 3 * GIB)]))  # a process that is not the worker's holds 3 GiB
    worker = c.start_gpu(
        0, wait=False, GPUHEDGE_NVML_REPLAY=str(answers), GPUHEDGE_HEALTH_INTERVAL_S="0.3"
    )
    c.wait_ready(worker, c.start_coordinator(wait=False))
    assert "pid 999999 (3072 MiB)" in out_reasons(c.store, gpu)[OUT_HEALTH]["detail"]
    waiting = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 1.5, "id": "w"},))
    table = json.loads(cli_run(c, "leases", "--json").output)["gpus"][0]
    assert table["availability"] == "out" and table["health"]["processes"][0]["ours"] is False
    assert "1 proc (1 foreign)" in cli_run(c, "leases").output
    passed = reconcile_once(c.app, c.store, timeout_s=2.0)
    assert passed["health"][gpu]["health"].startswith("memory held by a process")
    assert not waiting.ready() and c.store.last_token(gpu) == 0

    say(device())  # the process is gone
    wait_for(lambda: running(c, gpu), 10, "the waiting job to start once the GPU is back")
    say(device(ecc=1))  # an uncorrected ECC error while the job runs
    wait_for(lambda: out_reasons(c.store, gpu).get(OUT_FAULT), 5, "the GPU drained")
    assert waiting.get(timeout=30)["output"]["echo"]["id"] == "w", "the running job finished"
    say(device())
    time.sleep(1.0)
    assert "ECC" in out_reasons(c.store, gpu)[OUT_FAULT]["detail"], "until an operator says so"
    after = c.app.send_task(TASK_POOLED_INFER, ({"duration_s": 0, "id": "after"},))
    threading.Timer(0.5, cli_run, args=(c, "gpus", "undrain", gpu)).start()
    assert after.get(timeout=30)["output"]["echo"]["id"] == "after"
