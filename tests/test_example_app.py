"""The example under examples/existing_app: a separate Celery app calls hedged_infer and gets a
result, by name, by import and in a chain ending on its own worker (all real processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.fixtures_races import REPO, start_race_cluster, stop_race_cluster

pytestmark = pytest.mark.timeout(180)

EXAMPLE = REPO / "examples" / "existing_app"


def start_example_worker(env: dict[str, str], log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "celery", "-A", "tts_app", "worker", "-Q", "tts",
            "--pool", "solo", "-n", f"tts.{os.getpid()}@localhost", "--loglevel", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            argv, cwd=EXAMPLE, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while " ready." not in log.read_text(errors="replace"):
        assert worker.poll() is None, log.read_text(errors="replace")
        assert time.monotonic() < deadline, log.read_text(errors="replace")
        time.sleep(0.1)
    return worker


def test_existing_app_calls_hedged_infer_and_gets_a_result(redis_url, tmp_path):
    rc = start_race_cluster(redis_url, tmp_path, workers=1)
    env = {
        **os.environ,
        "BROKER_URL": redis_url,
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
