"""Warm ``python:`` runners and the ``server:`` runner, against a real local model server process.

* ``python:``: nothing is imported before ``load()``; a class is built and loaded once and kept
  across jobs; the module form and plain functions work; a failed load says why and loads again.
* ``server:``: spec options, the idle answers of JSON and Prometheus servers, a completion from
  the real server (tests/support/model_server.py, a PyTorch network behind HTTP), an in-flight
  request aborted when the lease is lost (the server sees the client go and stops generating;
  the runner returns once the server says it is idle), the per-request timeout, a server that
  refuses or is still loading (``RunnerUnavailable``).
* the supervisor of a server the worker starts: out of the pool until ready, a ``kill -9`` of the
  server takes the GPU out, it is restarted with backoff and the GPU comes back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpuhedge_celery.core.lease_rules import OUT_RUNNER
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.runners import (
    PythonRunner,
    RunContext,
    RunnerFailed,
    RunnerStopped,
    RunnerUnavailable,
    runner_from_spec,
)
from gpuhedge_celery.server_runner import ServerRunner, http_get, idle_value
from gpuhedge_celery.store.availability import out_reasons
from gpuhedge_celery.tasks.model_server import ServerSupervisor
from tests.support import warm_examples
from tests.support.fixtures_leases import add_pool
from tests.support.redis_server import free_port
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]
SERVER = REPO / "tests" / "support" / "model_server.py"


def server_argv(port: int, *extra: str) -> list[str]:
    return [sys.executable, str(SERVER), "--port", str(port), *extra]


@pytest.fixture(scope="module")
def model_server():
    """A real model server process on a free loopback port (its URL), ready."""
    port = free_port()
    proc = subprocess.Popen(server_argv(port, "--token-s", "0.02"), env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    runner = ServerRunner.parse(f"{url}/v1/completions")
    try:
        wait_for(lambda: runner.probe_ready()[0], 60, "the model server to be ready", 0.1)
        yield url
    finally:
        proc.kill()
        proc.wait(10)


def stats(url: str) -> dict:
    import json

    return json.loads(http_get(f"{url}/stats")[1])


# -- python: --------------------------------------------------------------------------------
def test_nothing_is_imported_before_load():
    sys.modules.pop("tests.support.warm_lazy", None)
    runner = runner_from_spec("python:tests.support.warm_lazy:Model")
    assert isinstance(runner, PythonRunner) and not runner.ready.is_set()
    assert "tests.support.warm_lazy" not in sys.modules, "the parent never imports the model"
    runner.load()
    assert runner.ready.is_set() and "tests.support.warm_lazy" in sys.modules
    assert runner.run(1, RunContext()) == {"lazy": 1}


def test_a_class_is_loaded_once_and_stays_warm():
    warm_examples.LOADED.clear()
    runner = runner_from_spec("python:tests.support.warm_examples:Counter")
    runner.load()
    runner.load()  # a second call is a no-op
    outs = [runner.run(i, RunContext(gpu_id="h:0")) for i in range(3)]
    assert [o["runs"] for o in outs] == [1, 2, 3] and outs[0]["gpu"] == "h:0"
    assert warm_examples.LOADED == ["Counter"]
    runner.close()
    assert warm_examples.CLOSED[-1] == "Counter" and not runner.ready.is_set()
    assert runner.run("x", RunContext())["runs"] == 1, "a closed model loads again, fresh"
    assert warm_examples.LOADED == ["Counter", "Counter"]


def test_module_and_function_forms():
    module = runner_from_spec("python:tests.support.warm_examples")
    assert module.run(5, RunContext()) == 15
    module.close()
    assert warm_examples.CLOSED[-1] == "module"
    assert runner_from_spec("python:tests.test_runners:double").run(4, RunContext()) == 8


def test_a_failed_load_says_why_and_is_retried():
    broken = runner_from_spec("python:tests.support.warm_examples:Broken")
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        broken.load()
    assert not broken.ready.is_set()
    with pytest.raises(ConfigError, match="has no attribute 'Missing'"):
        runner_from_spec("python:tests.support.warm_examples:Missing").load()
    with pytest.raises(ConfigError, match="has no run"):
        runner_from_spec("python:tests.support.warm_examples:NoRun").load()


def test_a_model_that_checks_ctx_stops_and_its_result_is_fenced():
    runner = runner_from_spec("python:tests.support.warm_examples:Counter")
    ctx = RunContext(gpu_id="h:0")
    ctx.stop.set()
    with pytest.raises(RunnerStopped):
        runner.run("late", ctx)


# -- server: --------------------------------------------------------------------------------
def test_server_spec_options_and_errors():
    runner = ServerRunner.parse(
        "http://127.0.0.1:9/v1/completions;timeout=7;idle=http://127.0.0.1:9/metrics;"
        "idle_metric=vllm:num_requests_running;drain=2;boot=30"
    )
    assert (runner.timeout_s, runner.drain_s, runner.boot_s) == (7, 2, 30)
    assert runner.ready_url == "http://127.0.0.1:9/health"
    assert runner.idle_metric == "vllm:num_requests_running"
    for bad, key in [
        ("ftp://x/y", "server"),
        ("http://h/v1;timeout=0", "server timeout"),
        ("http://h/v1;speed=3", "server"),
        ("http://h/v1;ready", "server"),
    ]:
        with pytest.raises(ConfigError, match=key):
            runner_from_spec(f"server:{bad}")


def test_idle_answers_json_and_prometheus():
    assert idle_value('{"running": 0, "waiting": 3}', "running") == 0
    assert idle_value('{"running": 2}', "running") == 2
    assert idle_value('{"busy": true}', "running") is None
    prom = (
        "# HELP vllm:num_requests_running Number of requests running\n"
        'vllm:num_requests_running{model_name="a"} 1.0\n'
        'vllm:num_requests_running{model_name="b"} 0.0\n'
        "vllm:num_requests_waiting 4.0\n"
    )
    assert idle_value(prom, "vllm:num_requests_running") == 1.0
    assert idle_value(prom, "absent_metric") is None


def test_a_completion_from_the_real_server(model_server):
    runner = runner_from_spec(f"server:{model_server}/v1/completions")
    out = runner.run({"prompt": "hello there", "max_tokens": 3}, RunContext())
    assert out["object"] == "text_completion" and len(out["choices"][0]["text"].split()) == 3
    assert out["compute_s"] > 0
    again = runner.run({"prompt": "hello there", "max_tokens": 3}, RunContext())
    assert again["choices"] == out["choices"], "the same network gives the same text"


def test_lease_loss_aborts_the_request_and_waits_for_idle(model_server):
    spec = (
        f"server:{model_server}/v1/completions;idle={model_server}/metrics;"
        "idle_metric=model_requests_running;drain=10"
    )
    runner = runner_from_spec(spec)
    before = stats(model_server)
    ctx = RunContext(gpu_id="h:0")
    threading.Timer(0.3, ctx.stop.set).start()
    started = time.monotonic()
    with pytest.raises(RunnerStopped, match="aborted: its lease was lost"):
        runner.run({"prompt": "long", "max_tokens": 500}, ctx)  # 10 s if not aborted
    assert time.monotonic() - started < 3
    after = stats(model_server)
    assert after["aborted"] == before["aborted"] + 1, "the server stopped generating"
    assert after["running"] == 0 and after["served"] == before["served"]


def test_without_an_idle_probe_the_abort_waits_the_whole_bound(model_server):
    runner = runner_from_spec(f"server:{model_server}/v1/completions;drain=0.5")
    ctx = RunContext(gpu_id="h:0")
    threading.Timer(0.2, ctx.stop.set).start()
    started = time.monotonic()
    with pytest.raises(RunnerStopped):
        runner.run({"prompt": "x", "max_tokens": 500}, ctx)
    assert 0.65 <= time.monotonic() - started < 3


def test_timeout_refused_and_not_found(model_server):
    slow = runner_from_spec(f"server:{model_server}/v1/completions;timeout=0.3")
    with pytest.raises(RunnerFailed, match="did not answer within 0.3 s"):
        slow.run({"prompt": "x", "max_tokens": 500}, RunContext())
    wrong = runner_from_spec(f"server:{model_server}/v1/nothing")
    with pytest.raises(RunnerFailed, match="answered 404"):
        wrong.run({}, RunContext())
    refused = runner_from_spec(f"server:http://127.0.0.1:{free_port()}/v1/completions")
    with pytest.raises(RunnerUnavailable, match="is not answering"):
        refused.run({}, RunContext())


def test_supervisor_starts_waits_restarts_with_backoff(lease_store, tmp_path):
    (gpu,) = add_pool(lease_store, "p", 1)
    port = free_port()
    pidfile = tmp_path / "server.pid"
    runner = ServerRunner.parse(f"http://127.0.0.1:{port}/v1/completions")
    command = " ".join(server_argv(port, "--boot-s", "2", "--pidfile", str(pidfile)))
    supervisor = ServerSupervisor(runner, command, lease_store, gpu, retry_s=0.3, retry_max_s=1)
    supervisor.start()
    try:
        wait_for(lambda: out_reasons(lease_store, gpu), 10, "the GPU to be out while it boots")
        assert "starting the model server" in out_reasons(lease_store, gpu)[OUT_RUNNER]["detail"]

        def booting():
            try:
                return http_get(runner.ready_url)[0] == 503
            except OSError:
                return False

        wait_for(booting, 60, "the server to answer 503 while it loads", 0.05)
        with pytest.raises(RunnerUnavailable, match="not ready"):
            runner.run({"prompt": "x"}, RunContext())
        wait_for(lambda: not out_reasons(lease_store, gpu), 60, "the GPU to join the pool")
        first = int(pidfile.read_text())
        os.kill(first, signal.SIGKILL)
        exited = wait_for(lambda: out_reasons(lease_store, gpu).get(OUT_RUNNER), 5, "out")
        assert "model server exited with code -9; restarting it in 0.3 s" in exited["detail"]
        assert lease_store.try_claim(gpu, "t") is None, "no lease while the server is down"
        wait_for(lambda: not out_reasons(lease_store, gpu), 60, "the GPU back after a restart")
        assert supervisor.starts == 2 and int(pidfile.read_text()) != first
        assert runner.run({"prompt": "x", "max_tokens": 1}, RunContext())["choices"]
    finally:
        supervisor.stop()
    assert supervisor.process is None
    with pytest.raises(OSError):
        http_get(runner.ready_url, timeout_s=1)  # the server went with the supervisor


def test_supervisor_of_a_server_already_running(lease_store, tmp_path):
    """No command: the worker only watches the server, and keeps the GPU out while it is down."""
    (gpu,) = add_pool(lease_store, "p", 1)
    port = free_port()
    runner = ServerRunner.parse(f"http://127.0.0.1:{port}/v1/completions")
    supervisor = ServerSupervisor(runner, None, lease_store, gpu, retry_s=0.3, retry_max_s=1)
    supervisor.start()
    server = None
    try:
        assert supervisor.ready.wait(0.5) is False and lease_store.try_claim(gpu, "t") is None
        server = subprocess.Popen(server_argv(port))
        wait_for(supervisor.ready.is_set, 60, "the running server to be found ready")
        assert out_reasons(lease_store, gpu) == {} and supervisor.starts == 0
        server.kill()
        server.wait(10)
        gone = wait_for(lambda: out_reasons(lease_store, gpu).get(OUT_RUNNER), 15, "out")
        assert "model server not ready" in gone["detail"] and "does not answer" in gone["detail"]
        server = subprocess.Popen(server_argv(port))
        wait_for(lambda: not out_reasons(lease_store, gpu), 60, "the GPU back with the server")
    finally:
        supervisor.stop()
        if server is not None:
            server.kill()
            server.wait(10)
