"""The example under examples/existing_app: a separate Celery app calls hedged_infer and gets a
result, by name, by import and in a chain ending on its own worker (all real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.example_app import EXAMPLE, start_example_worker
from tests.support.fixtures_celery import broker_url_for
from tests.support.fixtures_races import start_race_cluster, stop_race_cluster

pytestmark = [pytest.mark.timeout(180), pytest.mark.cluster]


def app_env(rc) -> dict[str, str]:
    """The example app's broker and results: the workers' (the broker's Redis holds the results
    beside a Redis Cluster store, whose URL the callers' gpuhedge settings still name)."""
    glue = rc.app.gpuhedge_config
    env = {"BROKER_URL": glue.broker, "RESULT_BACKEND": glue.results_url}
    if glue.broker_url is not None:
        env["GPUHEDGE_BROKER_URL"] = glue.broker_url
    return env


def test_existing_app_calls_hedged_infer_and_gets_a_result(redis_url, tmp_path, broker, request):
    rc = start_race_cluster(
        redis_url, tmp_path, workers=1, broker_url=broker_url_for(broker, request)
    )
    env = {
        **os.environ,
        **app_env(rc),
        "BROKER_KEYPREFIX": f"{rc.prefix}:",
        "GPUHEDGE_REDIS_URL": redis_url,
        "GPUHEDGE_PREFIX": rc.prefix,
        "GPUHEDGE_BROKER_PREFIX": f"{rc.prefix}:",
        "EXAMPLE_SIM": json.dumps({"p": {"queue_s": 0.5, "run_s": 2}}),
    }
    env.pop("GPUHEDGE_CONFIG", None)
    worker = start_example_worker(env, tmp_path / "tts.log")
    try:
        done = subprocess.run(
            [sys.executable, "client.py", "hello"], cwd=EXAMPLE, env=env,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr + rc.logs()
        out = json.loads(done.stdout.strip().splitlines()[-1])
        for way in ("by_name", "by_import"):
            assert out[way]["winner"] == "p" and out[way]["hedged"] is False
            assert rc.receipt(out[way]["race_id"])["winner_provider"] == "p"
        chained = out["chained"]
        assert chained["winner"] == "p" and len(chained["sha256"]) == 64
        assert rc.receipt(chained["race_id"])["finished"] is True
    finally:
        os.killpg(worker.pid, 9)
        worker.wait(10)
        stop_race_cluster(rc)


def test_the_client_reports_a_failed_race_in_one_line_without_a_traceback(
    redis_url, tmp_path, broker, request
):
    rc = start_race_cluster(
        redis_url, tmp_path, workers=1, broker_url=broker_url_for(broker, request)
    )
    failing = {"queue_s": 0.2, "run_s": 0.5, "outcome": "failed"}
    env = {
        **os.environ,
        **app_env(rc),
        "BROKER_KEYPREFIX": f"{rc.prefix}:",
        "GPUHEDGE_REDIS_URL": redis_url,
        "GPUHEDGE_PREFIX": rc.prefix,
        "GPUHEDGE_BROKER_PREFIX": f"{rc.prefix}:",
        "EXAMPLE_SIM": json.dumps({"p": failing, "h": failing}),
    }
    env.pop("GPUHEDGE_CONFIG", None)
    try:
        done = subprocess.run(
            [sys.executable, "client.py", "hello"], cwd=EXAMPLE, env=env,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 1, done.stdout + done.stderr + rc.logs()
        assert "Traceback" not in done.stderr, done.stderr
        first, hint = done.stderr.strip().splitlines()
        # each attempt and why it lost, in the message itself
        assert "no attempt returned a valid result" in first
        assert "p (primary) FAILED: simulated job failure" in first
        assert "h (hedge) FAILED: simulated job failure" in first
        race_id = hint.rsplit(" ", 1)[-1]
        assert rc.receipt(race_id)["winner"] is None
    finally:
        stop_race_cluster(rc)
