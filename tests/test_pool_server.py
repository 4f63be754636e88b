"""The ``server:`` runner in real GPU workers, with a real local model server process.

The GPU worker starts tests/support/model_server.py itself (``GPUHEDGE_SERVER_CMD``), keeps its
GPU out of the pool until the server is ready, and sends each pooled request to it over HTTP:

* requests are served by the one server process (warm), whatever the worker's child does;
* ``kill -9`` of the server: the GPU leaves the pool, a request sent meanwhile waits (no lease is
  taken on the GPU), the server is restarted with backoff and the request completes;
* the job's lease lost mid-request: the request is aborted at the server (it sees the client go),
  the worker waits for the server to be idle, and the request runs again and completes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from gpuhedge_celery.core.lease_rules import OUT_RUNNER
from gpuhedge_celery.server_runner import http_get
from gpuhedge_celery.store.availability import out_reasons
from gpuhedge_celery.tasks.app import TASK_POOLED_INFER
from tests.support.redis_server import free_port
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.slow, pytest.mark.brokers]

REPO = Path(__file__).resolve().parents[1]
SERVER = REPO / "tests" / "support" / "model_server.py"


def start_server_gpu(cluster, tmp_path, **extra):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pidfile = tmp_path / "server.pid"
    worker = cluster.start_gpu(
        0,
        runner=f"server:{url}/v1/completions;idle={url}/idle;drain=5;timeout=60",
        wait=False,
        GPUHEDGE_SERVER_CMD=f"{sys.executable} {SERVER} --port {port} --pidfile {pidfile}",
        GPUHEDGE_RUNNER_RETRY_S="0.5",
        PYTHONPATH=str(REPO),
        **extra,
    )
    return worker, url, pidfile


def stats(url: str) -> dict:
    return json.loads(http_get(f"{url}/stats")[1])


def serving(cluster, gpu: str) -> bool:
    return not out_reasons(cluster.store, gpu)


def test_served_by_one_server_restarted_after_a_crash(celery_cluster, tmp_path):
    c = celery_cluster
    gpu = c.gpu_id(0)
    worker, url, pidfile = start_server_gpu(c, tmp_path)
    c.wait_ready(worker, c.start_coordinator(wait=False))
    results = [
        c.app.send_task(TASK_POOLED_INFER, ({"prompt": f"p{i}", "max_tokens": 2},))
        for i in range(3)
    ]
    outs = [r.get(timeout=120) for r in results]
    first = int(pidfile.read_text())
    assert {o["output"]["pid"] for o in outs} == {first}
    assert all(o["output"]["object"] == "text_completion" for o in outs)
    # Sent while the server was still loading: they waited for it, none bounced off it.
    assert [o["attempt"] for o in outs] == [0, 0, 0] and len({o["token"] for o in outs}) == 3
    assert c.store.last_token(gpu) == max(o["token"] for o in outs), "one lease per request"
    assert first in _descendants(worker.pid), "the worker's main process started the server"

    os.kill(first, signal.SIGKILL)
    detail = wait_for(lambda: out_reasons(c.store, gpu).get(OUT_RUNNER), 10, "the GPU out")
    assert "model server exited with code -9" in detail["detail"]
    token_before = c.store.last_token(gpu)
    waiting = c.app.send_task(TASK_POOLED_INFER, ({"prompt": "after", "max_tokens": 1},))
    out = waiting.get(timeout=120)
    assert out["attempt"] == 0, "it waited for the GPU instead of failing on a dead server"
    assert out["output"]["pid"] == int(pidfile.read_text()) != first
    assert c.store.last_token(gpu) == out["token"] > token_before, "one lease, once it served"


def test_lease_loss_aborts_the_request_at_the_server(celery_cluster, tmp_path):
    c = celery_cluster
    gpu = c.gpu_id(0)
    worker, url, _ = start_server_gpu(c, tmp_path, GPUHEDGE_POOL_TTL_MS="1500")
    c.wait_ready(worker, c.start_coordinator(wait=False))
    wait_for(lambda: serving(c, gpu), 60, "the server to be ready")
    request = {"prompt": "long", "max_tokens": 200, "token_s": 0.02}  # 4 s if not aborted
    result = c.app.send_task(TASK_POOLED_INFER, (request,))
    wait_for(lambda: stats(url)["running"] == 1, 60, "the request to reach the server")
    lease = c.store.current(gpu)
    assert c.store.force_release(gpu, lease.token)
    intruder = c.store.try_claim(gpu, "intruder", ttl_ms=1000)
    assert intruder is not None
    taken_at = time.monotonic()
    wait_for(lambda: stats(url)["aborted"] == 1, 5, "the server to see the request aborted")
    assert time.monotonic() - taken_at < 2.0, "aborted within a renewal period"
    out = result.get(timeout=120)
    assert out["attempt"] == 1 and len(out["output"]["choices"][0]["text"].split()) == 200
    final = stats(url)
    assert final["served"] == 1 and final["aborted"] == 1 and final["running"] == 0


def _descendants(root: int) -> set[int]:
    from gpuhedge_celery.tasks.health import process_tree

    return process_tree(root)
