"""The HTTP endpoints Prometheus scrapes: a worker's own, and ``gpuhedge-celery metrics serve``.

**A worker** (``GPUHEDGE_METRICS_PORT`` set) serves ``/metrics`` from its main process. A
worker whose pool forks (prefork: the GPU workers) uses ``prometheus_client``'s multiprocess
mode: every process of the worker (the main process and each child) writes its counters to
memory-mapped files in one directory, and the main process adds them up at each scrape. A
worker that runs everything in one process (the coordination worker's threads pool) keeps its
counters in memory and serves ``prometheus_client``'s default registry: several times cheaper
per event, and its hooks run on every race step. The multiprocess directory is
``PROMETHEUS_MULTIPROC_DIR`` when set (one directory per worker: its ``*.db`` files are wiped at
start, as the library requires), else ``<tmp>/gpuhedge-metrics-<port>`` (removed at a clean
shutdown; a killed worker's is reused by the next one on that port). The worker sets this up at
``celeryd_init``, after binding its port and before any metric exists or the pool forks.

Settings: ``GPUHEDGE_METRICS_PORT`` (no default: no endpoint), ``GPUHEDGE_METRICS_ADDR``
(``127.0.0.1``: set the address Prometheus reaches, such as ``0.0.0.0`` in a container). Every
worker on a host needs its own port.

Both serve from a few threads with a bounded queue: a client that sends nothing for
:data:`CLIENT_TIMEOUT_S` is dropped, and a connection beyond the queue's room is closed at once,
so slow or idle sockets cannot pile up threads in a worker.

**``metrics serve``** serves the gauges Redis holds (:mod:`.redis_gauges`), read per scrape.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from .. import envvars
from .. import settings as process_settings
from ..errors import ConfigError
from . import record

log = logging.getLogger(__name__)

PORT_VAR, ADDR_VAR = envvars.METRICS_PORT_VAR, envvars.METRICS_ADDR_VAR
MULTIPROC_VAR = "PROMETHEUS_MULTIPROC_DIR"
INSTALL_HINT = "pip install 'gpuhedge-celery[metrics]'"
DEFAULT_ADDR = "127.0.0.1"
CLIENT_TIMEOUT_S = 5.0  # a scrape's request arrives at once; a silent client is dropped
SERVE_THREADS, QUEUED = 4, 32


class _Server(WSGIServer):
    """A WSGI server that answers on :data:`SERVE_THREADS` threads, with at most
    :data:`QUEUED` connections waiting for one; beyond that a connection is closed at once."""

    allow_reuse_address = True
    request_queue_size = 128  # listen backlog: a burst is answered, not SYN-dropped

    def __init__(self, *args: Any, **kwargs: Any):
        self._pool = ThreadPoolExecutor(SERVE_THREADS, thread_name_prefix="gpuhedge-metrics")
        self._room = threading.BoundedSemaphore(SERVE_THREADS + QUEUED)
        super().__init__(*args, **kwargs)  # a failed bind calls server_close: the pool exists

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._room.acquire(blocking=False):
            self.shutdown_request(request)
            return
        self._pool.submit(self._answer, request, client_address)

    def _answer(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._room.release()

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class _QuietHandler(WSGIRequestHandler):
    timeout = CLIENT_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        """Scrapes are not worth a log line each."""


def make_http_server(registry: Any, addr: str, port: int) -> _Server:
    """An HTTP server answering every path with ``registry`` in the text format (not started);
    with ``registry`` None it is bound, and answers once :func:`serve_registry` sets one."""
    server = make_server(addr, port, _not_ready, _Server, handler_class=_QuietHandler)
    if registry is not None:
        serve_registry(server, registry)
    return server


def serve_registry(server: _Server, registry: Any) -> None:
    from prometheus_client import make_wsgi_app

    server.set_app(make_wsgi_app(registry))


def _not_ready(environ: Any, start_response: Any) -> list[bytes]:
    start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
    return [b"starting\n"]


def parse_port(raw: str | None, key: str = PORT_VAR) -> int | None:
    """A TCP port from the environment (None when unset); ConfigError naming ``key`` if bad."""
    return envvars.parse_port(raw, key)


class WorkerEndpoint:
    """A worker's ``/metrics``, served from its main process (``directory``: the multiprocess
    files, None for a single-process worker)."""

    def __init__(self, directory: str | None, owned: bool, server: _Server):
        self.directory = directory
        self.owned = owned  # a temporary directory of ours, removed at close
        self.server = server
        self.pid = os.getpid()
        self._thread = threading.Thread(
            target=server.serve_forever, name="gpuhedge-metrics", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> WorkerEndpoint:
        self._thread.start()
        return self

    def after_fork(self) -> None:
        """In a forked child: close the inherited listening socket (only the parent serves)."""
        if os.getpid() != self.pid:
            self.server.socket.close()

    def close(self) -> None:
        if os.getpid() != self.pid:
            return
        self.server.shutdown()
        self.server.server_close()
        if self.owned and self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)


def start_worker_endpoint(
    environ: Mapping[str, str] | None = None, *, forks: bool = True
) -> WorkerEndpoint | None:
    """Serve ``/metrics`` when ``GPUHEDGE_METRICS_PORT`` is set; in multiprocess mode when the
    worker's pool ``forks`` (or ``PROMETHEUS_MULTIPROC_DIR`` is set).

    Call in the worker's main process before anything records a metric and before the pool
    forks. Returns None when no port is set or metrics are off (``GPUHEDGE_METRICS=0``);
    ConfigError (one line naming the variable) when the port is bad or taken, or when
    ``prometheus_client`` is not installed.
    """
    env = os.environ if environ is None else environ  # also PROMETHEUS_MULTIPROC_DIR
    metrics = (
        process_settings.current().metrics
        if environ is None
        else process_settings.MetricsSettings.from_env(env)
    )
    port = metrics.port
    if port is None:
        return None
    if not metrics.enabled:
        log.warning("%s is set but GPUHEDGE_METRICS turns metrics off: no endpoint", PORT_VAR)
        return None
    if importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError(f"metrics need prometheus_client: {INSTALL_HINT}", key=PORT_VAR)
    addr = metrics.addr
    try:  # bound first: a worker whose port is taken must not touch another's files
        server = make_http_server(None, addr, port)
    except OSError as e:
        raise ConfigError(
            f"cannot serve metrics on {addr}:{port}: {e.strerror}", key=PORT_VAR
        ) from None
    if not forks and not (env.get(MULTIPROC_VAR) or "").strip():
        from prometheus_client import REGISTRY

        record.active()  # build the metrics now: the first scrape lists every family
        serve_registry(server, REGISTRY)
        endpoint = WorkerEndpoint(None, False, server).start()
        log.info("metrics: serving http://%s:%d/metrics", addr, endpoint.port)
        return endpoint
    try:
        directory, owned = _multiprocess_dir(env, port)
    except ConfigError:
        server.server_close()
        raise
    from prometheus_client import CollectorRegistry, multiprocess, values

    if not getattr(values.ValueClass, "_multiprocess", False):
        # Imported before the variable was set (Celery loads Flower's command plugin, which
        # imports prometheus_client): metrics made from now on must use the shared files.
        values.ValueClass = values.MultiProcessValue()
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    serve_registry(server, registry)
    endpoint = WorkerEndpoint(directory, owned, server).start()
    log.info(
        "metrics: serving http://%s:%d/metrics (multiprocess, files in %s)",
        addr,
        endpoint.port,
        directory,
    )
    return endpoint


def pool_forks(pool: Any) -> bool:
    """Whether a Celery pool (a name like ``prefork`` or ``threads``, or its class) runs tasks
    in forked child processes."""
    name = pool if isinstance(pool, str) else f"{getattr(pool, '__module__', '')}.{pool!r}"
    return any(word in name.lower() for word in ("prefork", "processes"))


def _multiprocess_dir(env: Mapping[str, str], port: int) -> tuple[str, bool]:
    """The multiprocess directory, emptied of the last run's files; sets the variable.

    ``PROMETHEUS_MULTIPROC_DIR`` when given, else ``<tmp>/gpuhedge-metrics-<port>``: one per
    port, so a worker killed without clean-up leaves one directory that its successor reuses.
    """
    given = (env.get(MULTIPROC_VAR) or "").strip()
    directory = given or os.path.join(tempfile.gettempdir(), f"gpuhedge-metrics-{port}")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        found = os.lstat(directory)
    except OSError as e:
        raise ConfigError(f"cannot create {directory}: {e.strerror}", key=MULTIPROC_VAR) from None
    if not given and (stat.S_ISLNK(found.st_mode) or found.st_uid != os.getuid()):
        raise ConfigError(
            f"{directory} is not a directory of this user; set {MULTIPROC_VAR}", key=MULTIPROC_VAR
        )
    for stale in glob.glob(os.path.join(directory, "*.db")):
        os.remove(stale)  # the previous run's counts: the library requires a clean start
    os.environ[MULTIPROC_VAR] = directory  # read whenever a process opens its file
    return directory, not given
