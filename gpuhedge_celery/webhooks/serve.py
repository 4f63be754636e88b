"""Serving the receiver: one uvicorn process, or several sharing one port (``--workers N``).

One delivery costs the receiver a few milliseconds of CPU, nearly all of it Python holding the
GIL (the HTTP request, the race read, the result's validation, the step's save and the
winner's report), so one process caps the deliveries a host can apply however many cores it
has. With ``workers > 1`` the command's process becomes a small supervisor that starts N
receiver processes (``spawn``: each imports afresh and builds its own race runtime, so its
own Redis and Celery clients, after the fork), each listening on ``host:port`` with
``SO_REUSEPORT``: the kernel spreads new connections over them by their address hash.

Every receiver applies any delivery: the token is checked with the shared secret, and a race's
state moves only by versioned saves in Redis, so a delivery and its retry landing on two
processes still make one event (the second finds the attempt ended and is acknowledged).

Supervision: ``SIGTERM``/``SIGINT`` to the supervisor stops every receiver gracefully (uvicorn
finishes the requests in hand). A receiver that exits is started again after 1 s, unless it
exits before it is ready (a bad config, Redis down, the port taken): then the supervisor stops
the others and exits with an error (status 2 for a configuration error, as the single-process
command does), and the process manager decides. A receiver also stops
when its supervisor dies (``PR_SET_PDEATHSIG``), so none is left holding the port.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import time
from multiprocessing.connection import wait
from typing import Any

READY_TIMEOUT_S = 60.0
RESTART_DELAY_S = 1.0


def uvicorn_config(app: Any, **kw: Any) -> Any:
    """The receiver's uvicorn settings: no access log, lifespan or proxy-header rewriting
    (the app reads neither the client address nor the scheme), no ``server``/``date`` headers
    (a delivery's answer is read by a provider's HTTP client only), and the header deadline
    and connection cap of :mod:`.guard` under this process's descriptor limit (raised to its
    hard limit first)."""
    import uvicorn

    from .guard import connection_cap, guarded_protocol, raise_fd_limit

    cap = connection_cap(raise_fd_limit())
    return uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        proxy_headers=False,
        server_header=False,
        date_header=False,
        timeout_keep_alive=30,
        http=guarded_protocol(cap),
        backlog=cap,
        **kw,
    )


def serve(host: str, port: int, *, workers: int = 1, threads: int = 16) -> int:
    """Serve until stopped; the exit status."""
    from ..secrets import quiet_http_client_logs

    quiet_http_client_logs()
    if workers <= 1:
        import uvicorn

        from .app import build_app

        uvicorn.Server(uvicorn_config(build_app(threads=threads), host=host, port=port)).run()
        return 0
    return Supervisor(host, port, workers, threads).run()


class NotStarted(RuntimeError):
    def __init__(self, text: str, code: int | None):
        super().__init__(text)
        self.code = code


class Supervisor:
    def __init__(self, host: str, port: int, workers: int, threads: int):
        self.host, self.port, self.workers, self.threads = host, port, workers, threads
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: dict[int, Any] = {}  # slot -> Process
        self.stopping = False

    def _start(self, slot: int) -> Any:
        ready = self.ctx.Event()
        proc = self.ctx.Process(
            target=_receiver,
            args=(self.host, self.port, self.threads, ready, os.getpid(), _log_level()),
            name=f"gpuhedge-webhooks-{slot}",
            daemon=False,
        )
        proc.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.wait(0.1):
            if not proc.is_alive() or time.monotonic() > deadline:
                proc.kill()
                proc.join(5)
                raise NotStarted(
                    f"receiver process {slot + 1} of {self.workers} did not start "
                    f"(exit status {proc.exitcode}; see its error above)",
                    proc.exitcode,
                )
        self.procs[slot] = proc
        return proc

    def _stop(self, *_: Any) -> None:
        self.stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        try:
            for slot in range(self.workers):
                self._start(slot)
            print(
                f"gpuhedge-celery webhooks: {self.workers} receiver processes (pids "
                f"{', '.join(str(p.pid) for p in self.procs.values())})",
                file=sys.stderr,
                flush=True,
            )
            while not self.stopping:
                wait([p.sentinel for p in self.procs.values()], timeout=0.5)
                for slot, proc in list(self.procs.items()):
                    if proc.is_alive() or self.stopping:
                        continue
                    print(
                        f"gpuhedge-celery webhooks: receiver pid {proc.pid} exited "
                        f"({proc.exitcode}); starting another",
                        file=sys.stderr,
                        flush=True,
                    )
                    time.sleep(RESTART_DELAY_S)
                    self._start(slot)
            return 0
        except NotStarted as e:
            print(f"gpuhedge-celery webhooks: {e}", file=sys.stderr, flush=True)
            return 2 if e.code == 2 else 1  # 2: a configuration error, as one process says
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)  # uvicorn: finish what is in hand
        deadline = time.monotonic() + 30
        for proc in self.procs.values():
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the call above
        os._exit(1)


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` that other receivers may bind too."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _log_level() -> int | None:
    """The level this process logs at when ``--log-level`` configured it, else None."""
    import logging

    root = logging.getLogger()
    return root.level if root.handlers else None


def _receiver(
    host: str, port: int, threads: int, ready: Any, parent: int, log_level: int | None = None
) -> None:
    """One receiver process (``spawn``): its own runtime and Redis clients, its own socket,
    logging as the command that started it (a spawned child inherits no logging set-up)."""
    _die_with_parent(parent)
    import uvicorn

    from ..secrets import log_to_stderr, quiet_http_client_logs

    quiet_http_client_logs()
    if log_level is not None:
        log_to_stderr(log_level)

    from ..errors import ConfigError
    from .app import build_app

    try:  # a bad config or Redis URL fails here, before ready
        app = build_app(threads=threads)
    except Exception as e:
        print(
            f"gpuhedge-celery webhooks: {' '.join(str(e).split())[:300]}",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(2 if isinstance(e, ConfigError) else 1)
    try:
        sock = reuseport_socket(host, port)
    except OSError as e:
        print(
            f"gpuhedge-celery webhooks: cannot listen on {host}:{port}: {e}",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)
    ready.set()
    import logging

    logging.getLogger(__name__).info(
        "receiver process %d serving on %s:%d", os.getpid(), host, port
    )
    uvicorn.Server(uvicorn_config(app)).run(sockets=[sock])
