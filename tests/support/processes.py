"""Stopping a child process the test support started (servers, fakes)."""

from __future__ import annotations

import subprocess


def stop_process(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM (a clean shutdown), then SIGKILL if it has not exited within ``grace_s``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
