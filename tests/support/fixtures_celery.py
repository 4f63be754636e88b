"""Real Celery worker processes for end-to-end tests (never ``task_always_eager``).

``celery_cluster`` starts ``celery -A gpuhedge_celery worker`` subprocesses against the test
Redis, isolated per test: a unique lease prefix and a unique broker key prefix (so queues, results
and remote-control broadcasts of other tests never mix). It waits until each worker is ready and
kills every worker it started at teardown. Worker logs are printed when a test fails.

    def test_x(celery_cluster):
        celery_cluster.start_gpu(0)                 # GPU worker for GPU "<host>:0"
        celery_cluster.start_coordinator()          # waits for GPUs on behalf of pooled_infer
        res = celery_cluster.app.send_task("gpuhedge.pooled_infer", ({"x": 1},))
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

READY_TIMEOUT_S = 60.0


@dataclass
class CeleryWorker:
    """One ``celery worker`` subprocess; ``children()`` are its prefork pool processes."""

    nodename: str
    process: subprocess.Popen
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    gpu_id: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def children(self) -> list[int]:
        """PIDs of the worker's direct child processes (its pool's children)."""
        path = Path(f"/proc/{self.pid}/task/{self.pid}/children")
        try:
            return [int(p) for p in path.read_text().split()]
        except OSError:
            return []

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the worker's main process only (SIGKILL: the whole worker dies uncleanly)."""
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self) -> None:
        """Kill the worker and every process of its group (children included) and reap it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class CeleryCluster:
    """Starts and tracks the worker processes of one test."""

    def __init__(self, redis_url: str, prefix: str, tmp_path: Path):
        from gpuhedge_celery.store.leases import LeaseStore
        from gpuhedge_celery.tasks.app import create_app
        from gpuhedge_celery.tasks.config import GlueConfig

        self.redis_url = redis_url
        self.prefix = prefix
        self.tmp_path = tmp_path
        self.host = f"{prefix}-host"
        self.env = {
            **os.environ,
            "GPUHEDGE_REDIS_URL": redis_url,
            "GPUHEDGE_PREFIX": prefix,
            "GPUHEDGE_BROKER_PREFIX": f"{prefix}:",
            "GPUHEDGE_HOST": self.host,
            "GPUHEDGE_COORD_CONCURRENCY": "8",
            "GPUHEDGE_RESTORE_INTERVAL_S": "1",
            "PYTHONUNBUFFERED": "1",
        }
        for name in ("GPUHEDGE_GPU", "GPUHEDGE_CONFIG", "CUDA_VISIBLE_DEVICES"):
            self.env.pop(name, None)
        self.config = GlueConfig.from_env(self.env)
        self.app = create_app(self.config)
        import redis

        self.client = redis.Redis.from_url(redis_url, decode_responses=True)
        self.store = LeaseStore(self.client, prefix)
        self.workers: list[CeleryWorker] = []
        self._count = 0

    def gpu_id(self, index: int | str) -> str:
        return f"{self.host}:{index}"

    def _start(self, role: str, env: dict[str, str]) -> CeleryWorker:
        self._count += 1
        nodename = f"{role}{self._count}.{self.prefix}@localhost"
        log_path = self.tmp_path / f"{role}{self._count}.log"
        argv = [
            sys.executable, "-m", "celery", "-A", "gpuhedge_celery", "worker",
            "-n", nodename, "--loglevel", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                argv,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=str(self.tmp_path),
                start_new_session=True,  # its own process group, killed whole at teardown
            )
        worker = CeleryWorker(nodename, process, log_path, env)
        self.workers.append(worker)
        return worker

    def _wait_ready(self, worker: CeleryWorker, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not worker.alive():
                raise RuntimeError(f"worker {worker.nodename} exited:\n{worker.log()[-3000:]}")
            if " ready." in worker.log():
                if worker.gpu_id is None or self.store.host_live(worker.nodename):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"worker {worker.nodename} not ready in {timeout_s}s:\n{worker.log()}")

    def start_coordinator(self, *, wait: bool = True, **extra: str) -> CeleryWorker:
        """A coordination worker (threads pool) that runs pooled_infer's waiting and reconcile."""
        worker = self._start("coord", {**self.env, **extra})
        if wait:
            self._wait_ready(worker)
        return worker

    def start_gpu(self, index: int | str, *, pool: str = "default", runner: str = "cpu",
                  wait: bool = True, **extra: str) -> CeleryWorker:  # fmt: skip
        """A GPU worker for GPU ``<host>:<index>`` in ``pool`` with the given runner spec."""
        env = {
            **self.env,
            "GPUHEDGE_GPU": str(index),
            "GPUHEDGE_POOL": pool,
            "GPUHEDGE_RUNNER": runner,
            **extra,
        }
        worker = self._start("gpu", env)
        worker.gpu_id = self.gpu_id(index)
        if wait:
            self._wait_ready(worker)
        return worker

    def start_beat(self, **extra: str) -> CeleryWorker:
        """``celery -A gpuhedge_celery beat`` (its schedule file in the test's tmp dir)."""
        self._count += 1
        log_path = self.tmp_path / f"beat{self._count}.log"
        argv = [sys.executable, "-m", "celery", "-A", "gpuhedge_celery", "beat", "--loglevel",
                "INFO", "--schedule", str(self.tmp_path / "beat-schedule")]  # fmt: skip
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(
                argv, env={**self.env, **extra}, stdout=log_file, stderr=subprocess.STDOUT,
                cwd=str(self.tmp_path), start_new_session=True,
            )  # fmt: skip
        beat = CeleryWorker(f"beat{self._count}", process, log_path, extra)
        self.workers.append(beat)
        return beat

    def wait_ready(self, *workers: CeleryWorker) -> None:
        for worker in workers:
            self._wait_ready(worker)

    def logs(self) -> str:
        return "\n".join(f"===== {w.nodename}\n{w.log()[-4000:]}" for w in self.workers)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.client.close()


@pytest.fixture
def celery_cluster(redis_url, prefix, tmp_path, request):
    """Start real Celery workers for this test; all are killed at teardown (logs on failure)."""
    import redis

    from gpuhedge_celery.store.listener import enable_notifications

    enable_notifications(redis.Redis.from_url(redis_url))
    cluster = CeleryCluster(redis_url, prefix, tmp_path)
    yield cluster
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        print(cluster.logs())
    cluster.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
