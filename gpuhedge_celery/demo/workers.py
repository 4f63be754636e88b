"""Local Celery worker processes for the demo: real ``celery -A gpuhedge_celery worker``s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LocalWorker:
    """One worker subprocess and its log file."""

    name: str
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def ready(self) -> bool:
        return " ready." in self.log()


class LocalWorkers:
    """Starts workers with a shared environment and stops them all (process groups) at exit."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.dir = Path(tempfile.mkdtemp(prefix="gpuhedge-demo-"))
        self.workers: list[LocalWorker] = []

    def start(self, name: str, **extra_env: str) -> LocalWorker:
        log_path = self.dir / f"{name}.log"
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "gpuhedge_celery",
            "worker",
            "-n",
            f"{name}@demo",
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        with open(log_path, "wb") as out:
            process = subprocess.Popen(
                argv,
                env={**self.env, **extra_env},
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(self.dir),
                start_new_session=True,
            )
        worker = LocalWorker(name, process, log_path)
        self.workers.append(worker)
        return worker

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for w in self.workers:
                if w.process.poll() is not None:
                    raise RuntimeError(f"demo worker {w.name} exited:\n{w.log()[-2000:]}")
            if all(w.ready() for w in self.workers):
                return
            time.sleep(0.05)
        raise RuntimeError(f"demo workers not ready after {timeout_s:.0f} s (logs in {self.dir})")

    def stop(self) -> None:
        for w in self.workers:
            try:
                os.killpg(w.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + 5
        for w in self.workers:
            try:
                w.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(w.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                w.process.wait(5)
