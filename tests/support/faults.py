"""Fault injection for the reliability tests: a Redis that can be stopped, frozen and restarted
on the same port (with or without AOF), and small helpers to wait out an outage.

Every server here is this test's own ``redis-server`` on a free loopback port: the machine's
shared Redis is never stopped, frozen or restarted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.support.processes import stop_process
from tests.support.redis_server import answers, free_port


@dataclass
class RestartableRedis:
    """A private ``redis-server`` that keeps its port and data directory across restarts.

    ``aof=True``: ``appendonly yes`` with ``appendfsync everysec`` (what docs/architecture.md
    recommends for races that must survive a restart); ``aof=False``: no persistence at all, so
    a restart starts empty. ``tls=True``: TLS only (``--port 0``), with a self-signed
    certificate generated here; :attr:`url` is then a ``rediss://`` URL that trusts it.
    """

    aof: bool = False
    port: int = field(default_factory=free_port)
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="gpuhedge-fault-redis-"))
    extra: tuple[str, ...] = ()
    process: subprocess.Popen | None = None
    starts: int = 0
    tls: bool = False
    password: str | None = None  # requirepass: the URL carries it

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            ca = os.path.join(self.workdir, "tls", "redis.pem")
            return (
                f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"
            )
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _listen_args(self) -> list[str]:
        if not self.tls:
            return ["--port", str(self.port)]
        from tests.support.certs import self_signed

        tls_dir = os.path.join(self.workdir, "tls")
        key = os.path.join(tls_dir, "redis.key")
        if not os.path.exists(key):  # the same certificate across restarts
            self_signed(Path(tls_dir), "redis", loopback=True)
        cert = os.path.join(tls_dir, "redis.pem")
        options = {
            "--port": "0",
            "--tls-port": str(self.port),
            "--tls-cert-file": cert,
            "--tls-key-file": key,
            "--tls-ca-cert-file": cert,
            "--tls-auth-clients": "no",
        }
        return [part for option in options.items() for part in option]

    def args(self) -> list[str]:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/test.sh installs it)")
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "everysec"]
            if self.aof
            else ["--appendonly", "no"]
        )
        auth = ["--requirepass", self.password] if self.password else []
        return [
            binary, "--bind", "127.0.0.1", *self._listen_args(), *auth, "--save", "",
            "--dir", self.workdir, "--notify-keyspace-events", "Egx", *persistence, *self.extra,
        ]  # fmt: skip

    def start(self, timeout_s: float = 10.0) -> RestartableRedis:
        """Start (or start again) on the same port and directory; wait until it answers."""
        assert self.process is None or self.process.poll() is not None, "already running"
        self.process = subprocess.Popen(
            self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if answers(self.url) and self._loaded():
                self.starts += 1
                return self
            if self.process.poll() is not None:
                break
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not (re)start")

    def _loaded(self) -> bool:
        try:
            info = redis.Redis.from_url(self.url, socket_connect_timeout=1).info("persistence")
        except redis.RedisError:
            return False
        return not info.get("loading", 0)

    def stop(self) -> None:
        """A clean ``SHUTDOWN`` (SIGTERM): with AOF, everything written so far is on disk."""
        if self.process is not None:
            stop_process(self.process)

    def kill(self) -> None:
        """``kill -9``: with ``everysec``, up to a second of writes may be lost."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def freeze(self) -> None:
        """SIGSTOP: the server holds its sockets open but answers nothing (a hung primary)."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.kill(self.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(interval_s)


def logged_run(request, ctx):
    """A ``python:`` GPU runner for the fault tests: sleeps ``request["duration_s"]`` (stopping
    at once when the worker loses its lease) and appends ``start``/``end`` lines with the GPU,
    the lease token and the wall time to ``$GPUHEDGE_TEST_RUN_LOG``, so a test can check that
    no GPU ever ran two jobs at once and that tokens only grow."""
    path = os.environ["GPUHEDGE_TEST_RUN_LOG"]
    tag = f"{ctx.gpu_id} {ctx.token} {request.get('id', '')}"
    with open(path, "a") as f:
        f.write(f"start {tag} {time.time():.4f}\n")
    stopped = ctx.stop.wait(float(request.get("duration_s", 1.0)))
    with open(path, "a") as f:
        f.write(f"{'stopped' if stopped else 'end'} {tag} {time.time():.4f}\n")
    if stopped:
        from gpuhedge_celery.runners import RunnerStopped

        raise RunnerStopped("lease lost")
    return {"id": request.get("id"), "gpu_id": ctx.gpu_id, "token": ctx.token}


def run_intervals(path: str) -> dict[str, list[tuple[float, float, int, str]]]:
    """Per GPU, the (start, end, token, id) of every run in a :func:`logged_run` log."""
    open_runs: dict[tuple[str, str], tuple[float, int]] = {}
    runs: dict[str, list[tuple[float, float, int, str]]] = {}
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        return {}
    for line in lines:
        kind, gpu, token, rid, at = line.split()
        if kind == "start":
            open_runs[(gpu, rid)] = (float(at), int(token))
        else:
            began, tok = open_runs.pop((gpu, rid))
            runs.setdefault(gpu, []).append((began, float(at), tok, rid))
    for (gpu, rid), (began, tok) in open_runs.items():  # still running
        runs.setdefault(gpu, []).append((began, float("inf"), tok, rid))
    return runs


def double_holds(runs: dict[str, list[tuple[float, float, int, str]]]) -> list[str]:
    """Every pair of runs of one GPU that overlapped in time, or whose lease token did not
    grow (from :func:`run_intervals`): each is a GPU held twice. Empty when none was."""
    found = []
    for gpu, spans in runs.items():
        spans = sorted(spans)
        for (s1, e1, t1, r1), (s2, e2, t2, r2) in zip(spans, spans[1:], strict=False):
            if e1 > s2 or t2 <= t1:
                found.append(f"GPU {gpu}: {r1} (token {t1}, {s1:.3f}-{e1:.3f}) and "
                             f"{r2} (token {t2}, {s2:.3f}-{e2:.3f})")  # fmt: skip
    return found


# Races of the fault tests: the primary (1 s queued + 1.5 s running) outlives the hedge's 0.3 s
# timer; the hedge (0.5 s + 2 s) finishes later, so most races are won by the primary after a
# hedge was launched and the hedge's job is cancelled: every step a race can take.
HEDGED_REQUEST = {"sim": {"p": {"queue_s": 1, "run_s": 150}, "h": {"queue_s": 0.5, "run_s": 200}}}
QUICK_REQUEST = {"sim": {"p": {"queue_s": 0, "run_s": 0}}}


def fault_config(deadline_s: float) -> str:
    """The race tests' sim config with a race deadline of ``deadline_s`` real seconds."""
    from tests.support.fixtures_races import RACE_CONFIG

    provider_s = deadline_s / 0.01  # RACE_CONFIG runs at time_scale 0.01
    # caps of 30 s real: a race here ends by its result or its deadline, never by a cap
    out = RACE_CONFIG.replace(
        "  attempt_cap_s: 180\n", f"  attempt_cap_s: 3000\n  race_deadline_s: {provider_s:g}\n"
    )
    assert out != RACE_CONFIG
    return out


@contextlib.contextmanager
def stacks_on_failure(cluster):
    """Close ``cluster`` at the end; on a failure print every live worker's thread stacks
    (Celery answers SIGUSR1 with them) and the logs first."""
    try:
        yield cluster
    except BaseException:
        for worker in cluster.workers:
            if worker.alive():
                os.kill(worker.pid, signal.SIGUSR1)
        time.sleep(1.0)
        print(cluster.logs())
        raise
    finally:
        cluster.close()


def start_fault_cluster(redis_url: str, tmp, *, deadline_s: float, coordinators: int = 2,
                        gpus: int = 0, beat: bool = True, broker_url: str | None = None,
                        **env: str):  # fmt: skip
    """Real coordination workers (and GPU workers running :func:`logged_run`, and beat for the
    janitor and reconcile) on ``redis_url``, racing the sim config; returns the CeleryCluster
    (``broker_url``: the broker when it is not ``redis_url``, e.g. a RabbitMQ vhost)."""
    import uuid

    from tests.support.fixtures_celery import CeleryCluster
    from tests.support.fixtures_races import REPO

    tmp = Path(tmp)
    config_path = tmp / "faults.yaml"
    config_path.write_text(fault_config(deadline_s))
    cluster = CeleryCluster(redis_url, f"f{uuid.uuid4().hex[:10]}", tmp, broker_url)
    cluster.env.update({
        "GPUHEDGE_CONFIG": str(config_path),
        "GPUHEDGE_PLUGINS": "tests.support.fixtures_races",
        "PYTHONPATH": str(REPO),
        "GPUHEDGE_VISIBILITY_TIMEOUT_S": "5",
        "GPUHEDGE_RESTORE_INTERVAL_S": "1",
        "GPUHEDGE_RECONCILE_INTERVAL_S": "1",
        "GPUHEDGE_JANITOR_STALE_S": "5",
        "GPUHEDGE_TEST_RUN_LOG": str(tmp / "runs.log"),
        **env,
    })  # fmt: skip
    # the caller's own app reads the same config (RaceResult's bound for unknown races)
    cluster.config = type(cluster.config).from_env(cluster.env)
    from gpuhedge_celery.tasks.app import create_app

    cluster.app = create_app(cluster.config)
    started = [cluster.start_coordinator(wait=False) for _ in range(coordinators)]
    started += [
        cluster.start_gpu(i, wait=False, runner="python:tests.support.faults:logged_run",
                          GPUHEDGE_POOL_TTL_MS="3000")
        for i in range(gpus)
    ]  # fmt: skip
    cluster.wait_ready(*started)
    if beat:
        cluster.start_beat()
    return cluster


def send_race(cluster, request=None, **kwargs):
    """``send_task`` of a hedged race (``kwargs``: policy, providers, validator), wrapped as the
    RaceResult ``hedged_infer.delay`` gives."""
    from gpuhedge_celery.tasks.result import RaceResult

    sent = cluster.app.send_task(
        "gpuhedge.hedged_infer", (request or HEDGED_REQUEST,), kwargs, queue="gpuhedge.coord"
    )
    return RaceResult(sent.id, app=cluster.app)
