"""Loopback HTTP servers for webhook tests: a recorder that answers scripted codes, and the
real receiver application served by uvicorn on a thread."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Recorder:
    """Records every POST (path, body bytes, monotonic time); answers ``codes`` in turn, then
    200. ``url``: its root."""

    def __init__(self, codes: list[int] | None = None):
        self.codes = list(codes or [])
        self.posts: list[tuple[str, bytes, float]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                recorder.posts.append((self.path, body, time.monotonic()))
                code = recorder.codes.pop(0) if recorder.codes else 200
                self.send_response(code)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def wait(self, n: int, timeout_s: float = 10.0) -> list[tuple[str, bytes, float]]:
        deadline = time.monotonic() + timeout_s
        while len(self.posts) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return list(self.posts)

    def json(self, i: int) -> Any:
        return json.loads(self.posts[i][1])

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Served:
    """An ASGI app served by a real uvicorn server on a thread; ``url`` its root."""

    def __init__(self, app: Any):
        import uvicorn

        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", access_log=False)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError("uvicorn did not start")
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
