"""Real Celery worker processes for end-to-end tests (never ``task_always_eager``).

``celery_cluster`` starts ``celery -A gpuhedge_celery worker`` subprocesses against the test
Redis, isolated per test: a unique lease prefix and a unique broker key prefix (so queues, results
and remote-control broadcasts of other tests never mix). It waits until each worker is ready and
kills every worker it started at teardown. Worker logs are printed when a test fails.

Brokers: Redis (the default) or RabbitMQ, with Redis as the store either way. A test module
marked ``pytest.mark.brokers`` runs once per broker (test ids end in ``[redis]`` and
``[rabbitmq]``); on RabbitMQ each cluster gets a vhost of its own (tests/support/rabbitmq.py).
A module also marked ``pytest.mark.sentinel`` runs a third time, ``[sentinel]``: the store, the
Celery results and the broker all on the run's Sentinel group (a primary, two replicas, three
Sentinels: tests/support/sentinel.py), reached through its ``sentinel://`` URL (the
``redis_url`` fixture), with the workers waiting for both replicas as operators are told to
(``GPUHEDGE_REDIS_WAIT_REPLICAS``, docs/operations.md, *Failover*). Modules that kill, restart
or reconfigure their Redis are not marked. ``GPUHEDGE_TEST_BROKER=redis``, ``=rabbitmq`` or
``=sentinel`` runs every test on that one broker instead (``=sentinel`` also runs unmarked
modules there: a way to try one before marking it). A module marked ``pytest.mark.cluster``
runs once more, ``[cluster]``: the store on the run's three-master Redis Cluster
(tests/support/redis_cluster.py; the ``redis_url`` fixture), the broker and Celery's results on
the plain redis-server, as a cluster store requires; ``GPUHEDGE_TEST_BROKER=cluster`` runs
every test so.

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

from gpuhedge_celery.redis_url import is_sentinel

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

    def __init__(self, redis_url: str, prefix: str, tmp_path: Path, broker_url: str | None = None):
        from gpuhedge_celery.store.leases import LeaseStore
        from gpuhedge_celery.tasks.app import create_app
        from gpuhedge_celery.tasks.config import GlueConfig

        self.redis_url = redis_url
        self.broker_url = broker_url  # None: the broker is the test Redis
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
        self.env.pop("GPUHEDGE_BROKER_URL", None)
        if broker_url is not None:
            self.env["GPUHEDGE_BROKER_URL"] = broker_url
        from gpuhedge_celery.store.connection import redis_from_url

        self.client = redis_from_url(redis_url, decode_responses=True)  # a Sentinel URL too
        if is_sentinel(redis_url):  # behind Sentinel a winner waits for every replica
            replicas = self.client.info("replication")["connected_slaves"]
            self.env.setdefault("GPUHEDGE_REDIS_WAIT_REPLICAS", str(replicas))
        self.config = GlueConfig.from_env(self.env)
        self.app = create_app(self.config)
        self.store = LeaseStore(self.client, prefix)
        self.workers: list[CeleryWorker] = []
        self._count = 0
        self.loglevel = "INFO"  # of the workers and beat started from now on

    def gpu_id(self, index: int | str) -> str:
        return f"{self.host}:{index}"

    def _start(self, role: str, env: dict[str, str], extra_argv: tuple[str, ...] = ()
               ) -> CeleryWorker:  # fmt: skip
        self._count += 1
        nodename = f"{role}{self._count}.{self.prefix}@localhost"
        log_path = self.tmp_path / f"{role}{self._count}.log"
        argv = [
            sys.executable, "-m", "celery", "-A", "gpuhedge_celery", "worker",
            "-n", nodename, "--loglevel", self.loglevel,
            "--without-gossip", "--without-mingle", "--without-heartbeat", *extra_argv,
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
            log = worker.log()
            if " ready." in log:
                # The banner names the transport: a cluster meant for RabbitMQ or Sentinel never
                # runs on a plain Redis (whose transport is the package's own Redis class).
                broker = self.broker_url or self.redis_url
                amqp = broker.startswith(("amqp", "pyamqp"))
                transport = log.partition(".> transport:")[2].partition("\n")[0]
                assert ("amqp://" in transport) == amqp, log[:3000]
                assert ("SentinelTransport://" in transport) == is_sentinel(broker), log[:3000]
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
                  wait: bool = True, argv: tuple[str, ...] = (),
                  **extra: str) -> CeleryWorker:  # fmt: skip
        """A GPU worker for GPU ``<host>:<index>`` in ``pool`` with the given runner spec
        (``argv``: more ``celery worker`` options, e.g. ``("--pool", "solo")``)."""
        env = {
            **self.env,
            "GPUHEDGE_GPU": str(index),
            "GPUHEDGE_POOL": pool,
            "GPUHEDGE_RUNNER": runner,
            **extra,
        }
        worker = self._start("gpu", env, argv)
        worker.gpu_id = self.gpu_id(index)
        if wait:
            self._wait_ready(worker)
        return worker

    def start_beat(self, **extra: str) -> CeleryWorker:
        """``celery -A gpuhedge_celery beat`` (its schedule file in the test's tmp dir)."""
        self._count += 1
        log_path = self.tmp_path / f"beat{self._count}.log"
        argv = [sys.executable, "-m", "celery", "-A", "gpuhedge_celery", "beat", "--loglevel",
                self.loglevel, "--schedule", str(self.tmp_path / "beat-schedule")]  # fmt: skip
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
        forget_results(getattr(self, "app", None))


def forget_results(app) -> None:
    """Drop ``app``'s result subscriptions: an AsyncResult collected after its Redis is gone
    would otherwise retry the unsubscribe for 20 s inside whichever later test the GC runs in."""
    if app is None:
        return
    consumer = getattr(app.backend, "result_consumer", None)
    if consumer is None:
        return
    consumer.subscribed_to.clear()
    try:
        consumer.stop()
    except Exception:  # its Redis may already be gone; nothing is left to tell it
        pass


BROKERS = ("redis", "rabbitmq")
SENTINEL = "sentinel"  # the store, results and broker on a Sentinel group
CLUSTER = "cluster"  # the store on a Redis Cluster, broker and results on the plain Redis
BROKER_MARKS = ("brokers", SENTINEL, CLUSTER)


def test_brokers(
    brokers: bool = True, sentinel: bool = False, cluster: bool = False
) -> tuple[str, ...]:
    """The brokers a module runs under: both when marked ``brokers``, else the first, and
    ``sentinel`` and ``cluster`` too when marked so; ``GPUHEDGE_TEST_BROKER`` names the only
    one instead."""
    chosen = os.environ.get("GPUHEDGE_TEST_BROKER", "").strip().lower()
    if not chosen:
        extra = (*((SENTINEL,) if sentinel else ()), *((CLUSTER,) if cluster else ()))
        return (*(BROKERS if brokers else BROKERS[:1]), *extra)
    known = (*BROKERS, SENTINEL, CLUSTER)
    if chosen not in known:
        raise pytest.UsageError(f"GPUHEDGE_TEST_BROKER: expected one of {known}, got {chosen!r}")
    return (chosen,)


test_brokers.__test__ = False  # a helper, not a test


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "brokers: runs once per broker, Redis and RabbitMQ (GPUHEDGE_TEST_BROKER)"
    )
    config.addinivalue_line(
        "markers", "sentinel: runs once more with the store, results and broker on Sentinel"
    )
    config.addinivalue_line(
        "markers", "cluster: runs once more with the store on a Redis Cluster (broker apart)"
    )
    config.addinivalue_line(
        "markers",
        "one_redis: a test of a module marked cluster that checks what only one Redis does "
        "(the store and Celery's results on one server): it gets no [cluster] run",
    )


def pytest_generate_tests(metafunc):
    marked = {m: metafunc.definition.get_closest_marker(m) is not None for m in BROKER_MARKS}
    if "broker" in metafunc.fixturenames and any(marked.values()):
        chosen = test_brokers(marked["brokers"], marked[SENTINEL], marked[CLUSTER])
        if metafunc.definition.get_closest_marker("one_redis") is not None:
            chosen = tuple(b for b in chosen if b != CLUSTER) or BROKERS[:1]
        metafunc.parametrize("broker", chosen, indirect=True, scope="module")


@pytest.fixture(scope="module")
def broker(request):
    """``"redis"``, ``"rabbitmq"``, ``"sentinel"`` or ``"cluster"``: where this module's
    clusters keep their messages (and, on ``"sentinel"``, their store and results; on
    ``"cluster"`` their store, on a Redis Cluster: the ``redis_url`` fixture)."""
    return getattr(request, "param", test_brokers()[0])


@pytest.fixture(scope="session")
def amqp_vhosts():
    """Fresh vhosts on the test RabbitMQ. Fails (never skips) when none is reachable."""
    from tests.support.rabbitmq import VhostFactory, amqp_url, answers

    url = amqp_url()
    if not answers(url):
        pytest.fail(f"no RabbitMQ answers at {url}; run the README's test command "
                    "(scripts/test.sh), which starts or installs one")  # fmt: skip
    factory = VhostFactory(url)
    yield factory
    factory.close()


def broker_url_for(broker: str, request) -> str | None:
    """The broker URL a new cluster uses: None for the store's Redis (the plain one or the
    Sentinel group), the plain redis-server beside a cluster store, else a fresh vhost."""
    if broker in ("redis", SENTINEL):
        return None
    if broker == CLUSTER:
        return request.getfixturevalue("plain_redis_url")
    return request.getfixturevalue("amqp_vhosts").new_url()


@pytest.fixture
def celery_cluster(redis_url, prefix, tmp_path, request, broker):
    """Start real Celery workers for this test; all are killed at teardown (logs on failure)."""
    from gpuhedge_celery.store.connection import redis_from_url
    from gpuhedge_celery.store.listener import enable_notifications

    enable_notifications(redis_from_url(redis_url))
    cluster = CeleryCluster(redis_url, prefix, tmp_path, broker_url_for(broker, request))
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
