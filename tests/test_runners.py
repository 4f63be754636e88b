"""Runners: spec parsing, seeded duration distributions, and each runner kind for real."""

from __future__ import annotations

import statistics
import sys
import threading
import time

import pytest

from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.runners import (
    CommandRunner,
    CpuRunner,
    Duration,
    PythonRunner,
    RunContext,
    RunnerFailed,
    RunnerStopped,
    runner_from_spec,
)


def double(request):
    return request * 2


def with_ctx(request, ctx):
    return {"gpu": ctx.gpu_id, "token": ctx.token, "request": request}


def ignores_stop(request):
    time.sleep(0.2)
    return "done"


def explodes(request):
    raise RuntimeError("model crashed")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("fixed=0.2", Duration("fixed", 0.2)),
        ("uniform=0.1,0.3", Duration("uniform", 0.1, 0.3)),
        ("lognormal=0.25,0.5", Duration("lognormal", 0.25, 0.5)),
    ],
)
def test_duration_parse(text, expected):
    assert Duration.parse(text) == expected


@pytest.mark.parametrize(
    "text",
    ["fixed", "fixed=a", "uniform=0.3", "uniform=0.3,0.1", "lognormal=0,1", "gamma=1", "fixed=-1"],
)
def test_duration_parse_rejects(text):
    with pytest.raises(ConfigError):
        Duration.parse(text)


def test_lognormal_is_parametrised_by_its_mean_and_seeded():
    dist = Duration("lognormal", 0.25, 0.6, seed=7)
    draw = dist.sampler()
    values = [draw() for _ in range(20_000)]
    assert statistics.fmean(values) == pytest.approx(0.25, rel=0.05)
    again = dist.sampler()
    assert [again() for _ in range(5)] == values[:5]
    other = Duration("lognormal", 0.25, 0.6, seed=8).sampler()
    assert [other() for _ in range(5)] != values[:5]


def test_uniform_stays_in_bounds():
    draw = Duration("uniform", 0.1, 0.3, seed=1).sampler()
    values = [draw() for _ in range(1000)]
    assert 0.1 <= min(values) and max(values) <= 0.3
    assert Duration("uniform", 0.1, 0.3).mean == pytest.approx(0.2)


@pytest.mark.parametrize(
    "spec, kind",
    [
        ("cpu", CpuRunner),
        ("cpu:fixed=0.01", CpuRunner),
        ("cpu:lognormal=0.2,0.5;seed=3", CpuRunner),
        ("python:tests.test_runners:double", PythonRunner),
        ("cmd:cat", CommandRunner),
        (None, CpuRunner),
    ],
)
def test_runner_from_spec(spec, kind):
    assert isinstance(runner_from_spec(spec), kind)


@pytest.mark.parametrize(
    "spec",
    [
        "gpu",
        "cpu:fixed",
        "cpu:fixed=1;sid=2",
        "python:nomodule",
        "python:no.such.module:f",
        "python:not a module",
        "cmd:",
        "cmd:'unclosed",
    ],
)
def test_bad_runner_spec_is_a_config_error(spec):
    with pytest.raises(ConfigError):
        runner_from_spec(spec)


def test_cpu_runner_echoes_and_honours_duration_override():
    runner = runner_from_spec("cpu:fixed=5")
    ctx = RunContext(gpu_id="h:0", token=4)
    started = time.monotonic()
    out = runner.run({"duration_s": 0.05, "x": 1}, ctx)
    assert time.monotonic() - started < 2
    assert out == {"echo": {"duration_s": 0.05, "x": 1}, "gpu_id": "h:0", "token": 4,
                   "duration_s": 0.05}  # fmt: skip


def test_cpu_runner_seeded_durations_repeat():
    a = runner_from_spec("cpu:uniform=0,0.001;seed=5")
    b = runner_from_spec("cpu:uniform=0,0.001;seed=5")
    ctx = RunContext()
    assert [a.run(i, ctx)["duration_s"] for i in range(3)] == [
        b.run(i, ctx)["duration_s"] for i in range(3)
    ]


def test_cpu_runner_stops_when_the_lease_is_lost():
    ctx = RunContext(gpu_id="h:0")
    threading.Timer(0.1, ctx.stop.set).start()
    started = time.monotonic()
    with pytest.raises(RunnerStopped):
        runner_from_spec("cpu:fixed=30").run("x", ctx)
    assert time.monotonic() - started < 5


def test_callable_runner_with_and_without_ctx():
    assert runner_from_spec("python:tests.test_runners:double").run(21, RunContext()) == 42
    out = runner_from_spec("python:tests.test_runners:with_ctx").run(
        "r", RunContext(gpu_id="h:1", token=9)
    )
    assert out == {"gpu": "h:1", "token": 9, "request": "r"}


def test_callable_runner_result_is_fenced_after_lease_loss():
    ctx = RunContext(gpu_id="h:0")
    threading.Timer(0.05, ctx.stop.set).start()
    with pytest.raises(RunnerStopped):
        runner_from_spec("python:tests.test_runners:ignores_stop").run("x", ctx)


def test_callable_runner_failure_is_typed():
    with pytest.raises(RunnerFailed, match="model crashed"):
        runner_from_spec("python:tests.test_runners:explodes").run("x", RunContext())


def test_command_runner_speaks_json_over_stdio():
    code = "import json,sys; r=json.load(sys.stdin); print(json.dumps({'got': r, 'n': 2}))"
    runner = CommandRunner([sys.executable, "-c", code])
    assert runner.run({"a": 1}, RunContext()) == {"got": {"a": 1}, "n": 2}


def test_command_runner_passes_text_and_context_env():
    code = "import os; print('gpu', os.environ['CUDA_VISIBLE_DEVICES'])"
    runner = CommandRunner([sys.executable, "-c", code])
    assert runner.run(None, RunContext(env={"CUDA_VISIBLE_DEVICES": "3"})) == "gpu 3"


def test_command_runner_failure_names_exit_code_and_stderr():
    code = "import sys; sys.stderr.write('cuda oom\\n'); sys.exit(4)"
    with pytest.raises(RunnerFailed, match="exited with 4: cuda oom"):
        CommandRunner([sys.executable, "-c", code]).run({}, RunContext())


def test_command_runner_is_terminated_when_the_lease_is_lost():
    ctx = RunContext(gpu_id="h:0")
    threading.Timer(0.2, ctx.stop.set).start()
    started = time.monotonic()
    with pytest.raises(RunnerStopped):
        CommandRunner([sys.executable, "-c", "import time; time.sleep(30)"]).run({}, ctx)
    assert time.monotonic() - started < 10


def test_command_runner_missing_binary():
    with pytest.raises(RunnerFailed, match="cannot start"):
        CommandRunner(["/nonexistent/model-server"]).run({}, RunContext())


def test_a_command_inherits_what_it_needs_and_none_of_the_workers_credentials(monkeypatch):
    secrets = {
        "GPUHEDGE_REDIS_URL": "redis://:redis-pw-123@redis:6379/0",
        "GPUHEDGE_WEBHOOK_SECRET": "webhook-secret-0123456789",
        "RUNPOD_API_KEY": "rp_key_456", "AWS_SECRET_ACCESS_KEY": "aws-789",
        "HF_TOKEN": "hf_abc",
    }  # fmt: skip
    wanted = {"CUDA_VISIBLE_DEVICES": "3", "HF_HOME": "/models", "LC_ALL": "C.UTF-8",
              "MY_MODEL_DIR": "/srv/m"}  # fmt: skip
    for name, value in {**secrets, **wanted}.items():
        monkeypatch.setenv(name, value)
    code = "import json, os, sys; sys.stdin.read(); print(json.dumps(dict(os.environ)))"
    ctx = RunContext(gpu_id="box:0", token=7, env={"GPUHEDGE_LEASE_TOKEN": "7"})
    seen = CommandRunner([sys.executable, "-c", code]).run({}, ctx)
    assert not set(secrets) & set(seen), set(secrets) & set(seen)
    assert seen["GPUHEDGE_LEASE_TOKEN"] == "7" and seen["PATH"]
    assert {k: seen.get(k) for k in ("CUDA_VISIBLE_DEVICES", "HF_HOME", "LC_ALL")} == {
        "CUDA_VISIBLE_DEVICES": "3", "HF_HOME": "/models", "LC_ALL": "C.UTF-8"}  # fmt: skip
    assert "MY_MODEL_DIR" not in seen
    monkeypatch.setenv("GPUHEDGE_RUNNER_ENV", "MY_MODEL_DIR, HF_TOKEN")  # passed on purpose
    seen = CommandRunner([sys.executable, "-c", code]).run({}, ctx)
    assert seen["MY_MODEL_DIR"] == "/srv/m" and seen["HF_TOKEN"] == "hf_abc"
    assert "RUNPOD_API_KEY" not in seen and "GPUHEDGE_REDIS_URL" not in seen
