"""An embedded Redis (fakeredis over TCP) for the demo and quick trials: no server to install.

It is a simulation of Redis, named as such wherever it is used: it speaks the protocol, runs our
Lua scripts (through lupa) and publishes keyspace events for commands, but emits no ``expired``
events (our waiters' bounded re-check and deadline probes cover that). Two fixes make Celery
usable on it: ``TCP_NODELAY`` on accepted sockets (without it every pipeline stalls on Nagle's
algorithm) and a 1 ms socket poll instead of fakeredis's 10 ms.
"""

from __future__ import annotations

import socket
import socketserver
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import cast

_POLL_S = 0.005


@dataclass
class EmbeddedRedis:
    """A running embedded server; ``url`` points at it, ``stop()`` shuts it down."""

    url: str
    port: int
    _server: object
    _thread: threading.Thread

    def stop(self) -> None:
        self._server.shutdown()  # type: ignore[attr-defined]
        self._server.server_close()  # type: ignore[attr-defined]
        self._thread.join(5)


def start_embedded_redis(host: str = "127.0.0.1", port: int = 0) -> EmbeddedRedis:
    """Start fakeredis's TCP server in a daemon thread and return its URL."""
    from fakeredis import TcpFakeServer

    # the poll interval is a module global of the server's (no public knob): set where present
    home = sys.modules.get(TcpFakeServer.__module__)
    if home is not None and hasattr(home, "_POLL_INTERVAL"):
        home._POLL_INTERVAL = _POLL_S  # type: ignore[attr-defined]
    server = TcpFakeServer((host, port))
    base = cast("type[socketserver.StreamRequestHandler]", server.RequestHandlerClass)

    class NoDelayHandler(base):  # type: ignore[valid-type,misc]
        def setup(self) -> None:
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().setup()

    server.RequestHandlerClass = NoDelayHandler
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="embedded-redis", daemon=True)
    thread.start()
    bound_port = server.server_address[1]
    return EmbeddedRedis(
        url=f"redis://{host}:{bound_port}/0", port=bound_port, _server=server, _thread=thread
    )


@dataclass
class EmbeddedRedisProcess:
    """The embedded server in a child process of its own (its own GIL, so its own core)."""

    url: str
    port: int
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def spawn_embedded_redis(host: str = "127.0.0.1", timeout_s: float = 20.0) -> EmbeddedRedisProcess:
    """Start the embedded server in a child process and wait until it answers PING."""
    import redis

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    code = (
        "import sys, time; from gpuhedge_celery.store.embedded import start_embedded_redis;"
        f"start_embedded_redis({host!r}, {port});"
        "[time.sleep(3600) for _ in iter(int, 1)]"
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
    url = f"redis://{host}:{port}/0"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the embedded Redis process exited with code {process.returncode}")
        try:
            redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
            return EmbeddedRedisProcess(url=url, port=port, process=process)
        except redis.RedisError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"the embedded Redis on port {port} did not answer within {timeout_s} s")
