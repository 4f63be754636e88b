"""A raw HTTP server on 127.0.0.1 that answers every request with one scripted, possibly
hostile, response: any status, any content type, a body that is malformed, truncated (a
Content-Length longer than what is sent), dripped a few bytes at a time, or enormous.

It writes bytes to the socket itself (no http.server framing), so a test can send what a broken
or malicious provider would send. Set ``server.reply`` before each call."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from dataclasses import dataclass


@dataclass
class Reply:
    status: int = 200
    content_type: str | None = "application/json"
    body: bytes = b"{}"
    declared_length: int | None = None  # None: the body's length; larger: a truncated body
    drip_bytes: int = 0  # > 0: send the body this many bytes at a time...
    drip_delay_s: float = 0.0  # ...with this pause between pieces


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(5)
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                piece = sock.recv(65536)
                if not piece:
                    return
                data += piece
            head, _, rest = data.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip() or 0)
            while len(rest) < length:
                piece = sock.recv(65536)
                if not piece:
                    break
                rest += piece
            reply: Reply = self.server.reply  # type: ignore[attr-defined]
            self.server.requests += 1  # type: ignore[attr-defined]
            declared = len(reply.body) if reply.declared_length is None else reply.declared_length
            lines = [
                f"HTTP/1.1 {reply.status} X",
                f"Content-Length: {declared}",
                "Connection: close",
            ]
            if reply.content_type is not None:
                lines.append(f"Content-Type: {reply.content_type}")
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            if reply.drip_bytes > 0:
                stop = self.server.stopping  # type: ignore[attr-defined]
                for i in range(0, len(reply.body), reply.drip_bytes):
                    if stop.is_set():
                        return
                    sock.sendall(reply.body[i : i + reply.drip_bytes])
                    time.sleep(reply.drip_delay_s)
            else:
                sock.sendall(reply.body)
        except OSError:
            return


class HostileHttpServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.reply = Reply()
        self.requests = 0
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> HostileHttpServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()
