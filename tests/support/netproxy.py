"""A TCP proxy on 127.0.0.1 that makes the network between two of our processes slow and lossy.

Clients connect to the proxy's port instead of the server's (``GPUHEDGE_REDIS_URL`` pointing
at it, or a provider's ``base_url``). Every chunk read on either side is delivered to the other
``latency_s`` plus a uniform ``0..jitter_s`` later, in order (the delay is added in each
direction, as ``tc netem delay`` on loopback does: a round trip gains about twice it).
:meth:`cut` resets every open connection at once (whatever command was in flight on it is
lost, in either direction), and :meth:`drop_next_reply` cuts the next connection on which the
server answers, discarding that answer: the request arrived, its reply never does.

Threads only (a reader and a delayed writer per direction, per connection), no privileges, no
network namespace: loopback traffic only.
"""

from __future__ import annotations

import queue
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

_EOF = b""


@dataclass
class ProxyStats:
    accepted: int = 0
    cut: int = 0  # connections reset by cut() or drop_next_reply()
    replies_dropped: int = 0
    bytes_up: int = 0  # client -> server
    bytes_down: int = 0  # server -> client


@dataclass
class _Conn:
    client: socket.socket
    server: socket.socket
    closed: threading.Event = field(default_factory=threading.Event)


class NetProxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` with added delay, jitter and cuts."""

    def __init__(self, target_host: str, target_port: int, *, latency_s: float = 0.0,
                 jitter_s: float = 0.0, seed: int | None = None):  # fmt: skip
        self.target = (target_host, target_port)
        self.latency_s = latency_s
        self.jitter_s = jitter_s
        self.stats = ProxyStats()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
        self._drop_reply = 0
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(256)
        self.port = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, daemon=True, name="netproxy")

    @classmethod
    def for_url(cls, url: str, **kwargs) -> NetProxy:
        """A proxy in front of the ``redis://`` or ``http://`` server at ``url``."""
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        default = 6379 if parts.scheme.startswith("redis") else 80
        return cls(parts.hostname or "127.0.0.1", parts.port or default, **kwargs)

    def url_for(self, url: str) -> str:
        """``url`` with its host and port replaced by this proxy's."""
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(url)
        return urlunsplit(parts._replace(netloc=f"127.0.0.1:{self.port}"))

    # ------------------------------------------------------------------ control
    def set(self, latency_s: float, jitter_s: float = 0.0) -> None:
        """Change the added delay for chunks read from now on."""
        self.latency_s, self.jitter_s = latency_s, jitter_s

    def cut(self) -> int:
        """Reset every open connection now (RST both ways); returns how many were cut."""
        with self._lock:
            conns = [c for c in self._conns if not c.closed.is_set()]
            self._conns = []
        for conn in conns:
            self._reset(conn)
        self.stats.cut += len(conns)
        return len(conns)

    def drop_next_reply(self, count: int = 1) -> None:
        """Discard the next ``count`` server answers, each resetting its connection."""
        with self._lock:
            self._drop_reply += count

    def open_connections(self) -> int:
        with self._lock:
            return sum(1 for c in self._conns if not c.closed.is_set())

    def start(self) -> NetProxy:
        self._acceptor.start()
        return self

    def close(self) -> None:
        self._stopping.set()
        try:
            self._listener.close()
        except OSError:
            pass
        self.cut()

    def __enter__(self) -> NetProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(client, server)
            with self._lock:
                self._conns = [c for c in self._conns if not c.closed.is_set()] + [conn]
            self.stats.accepted += 1
            for src, dst, down in ((client, server, False), (server, client, True)):
                pending: queue.Queue = queue.Queue()
                threading.Thread(target=self._read, args=(conn, src, pending, down),
                                 daemon=True).start()  # fmt: skip
                threading.Thread(target=self._write, args=(conn, dst, pending),
                                 daemon=True).start()  # fmt: skip

    def _delay(self) -> float:
        return self.latency_s + (self._rng.uniform(0, self.jitter_s) if self.jitter_s else 0.0)

    def _read(self, conn: _Conn, src: socket.socket, pending: queue.Queue, down: bool) -> None:
        last_due = 0.0
        while not conn.closed.is_set():
            try:
                data = src.recv(65536)
            except OSError:
                data = _EOF
            if data and down and self._drop_reply:
                with self._lock:
                    drop = self._drop_reply > 0
                    if drop:
                        self._drop_reply -= 1
                if drop:
                    self.stats.replies_dropped += 1
                    self.stats.cut += 1
                    self._reset(conn)
                    return
            if data:
                if down:
                    self.stats.bytes_down += len(data)
                else:
                    self.stats.bytes_up += len(data)
            # in order: a chunk is never delivered before the one read before it
            last_due = max(last_due, time.monotonic() + self._delay())
            pending.put((last_due, data))
            if not data:
                return

    def _write(self, conn: _Conn, dst: socket.socket, pending: queue.Queue) -> None:
        while True:
            due, data = pending.get()
            wait = due - time.monotonic()
            if wait > 0 and conn.closed.wait(wait):
                return
            if conn.closed.is_set():
                return
            try:
                if data:
                    dst.sendall(data)
                else:  # the other side closed: pass the close on, then stop
                    dst.shutdown(socket.SHUT_WR)
                    return
            except OSError:
                self._reset(conn)
                return

    @staticmethod
    def _reset(conn: _Conn) -> None:
        if conn.closed.is_set():
            return
        conn.closed.set()
        for s in (conn.client, conn.server):
            try:  # SO_LINGER 0: close() sends RST, as a dropped network path looks to a peer
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)  # wakes this connection's reader threads
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass
