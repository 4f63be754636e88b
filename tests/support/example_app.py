"""The worker of examples/existing_app (``tts_app``): a plain Celery app that never imports
gpuhedge_celery, started as a real process on a given broker (and key prefix)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "existing_app"


def start_example_worker(env: dict[str, str], log: Path) -> subprocess.Popen:
    """``celery -A tts_app worker -Q tts`` in the example's directory; returns once ready.

    ``env`` gives its ``BROKER_URL`` and ``BROKER_KEYPREFIX``. Its node name is
    :func:`example_node`; stop it with ``os.killpg(worker.pid, 9)``.
    """
    argv = [sys.executable, "-m", "celery", "-A", "tts_app", "worker", "-Q", "tts",
            "--pool", "solo", "-n", example_node(), "--loglevel", "INFO",
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


def example_node() -> str:
    """The node name :func:`start_example_worker` gives the worker it starts from this process."""
    return f"tts.{os.getpid()}@localhost"
