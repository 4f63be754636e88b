"""An embedded Redis (fakeredis over TCP) for the demo and quick trials: no server to install.

It is a simulation of Redis, named as such wherever it is used: it speaks the protocol, runs our
Lua scripts (through lupa) and publishes keyspace events for commands, but emits no ``expired``
events (our waiters' bounded re-check and deadline probes cover that). Two fixes make Celery
usable on it: ``TCP_NODELAY`` on accepted sockets (without it every pipeline stalls ~40 ms on
Nagle's algorithm) and a 1 ms socket poll instead of fakeredis's 10 ms.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass

_POLL_S = 0.001


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
    from fakeredis._clients import _tcp_server as tcp

    tcp._POLL_INTERVAL = _POLL_S

    class NoDelayHandler(tcp.TCPFakeRequestHandler):
        def setup(self) -> None:
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().setup()

    server = tcp.TcpFakeServer((host, port))
    server.RequestHandlerClass = NoDelayHandler
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="embedded-redis", daemon=True)
    thread.start()
    bound_port = server.server_address[1]
    return EmbeddedRedis(
        url=f"redis://{host}:{bound_port}/0", port=bound_port, _server=server, _thread=thread
    )
