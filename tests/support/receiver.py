"""The webhook receiver (``gpuhedge-celery webhooks``) in its own process, for tests.

``start_receiver`` starts it on ``port`` with ``env``, its output in ``workdir/receiver.log``,
and returns once ``/healthz`` answers; one that exits or never answers fails with its log.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

CLI = (sys.executable, "-m", "gpuhedge_celery")


def start_receiver(
    env: dict[str, str], port: int, workdir: Path, *, cli: Any = CLI, timeout_s: float = 30.0
) -> subprocess.Popen[bytes]:
    log_path = Path(workdir) / "receiver.log"
    with open(log_path, "wb") as log:  # the child keeps its own handle
        proc = subprocess.Popen(
            [*cli, "webhooks", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(workdir),
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop_receiver(proc)
    raise RuntimeError(f"the receiver did not start:\n{log_path.read_text()[-2000:]}")


def stop_receiver(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
    if proc is not None:
        proc.wait(10)
