"""A small OpenAI-compatible model server for the ``server:`` runner's tests and the pool bench.

    python tests/support/model_server.py --port 8011 [--boot-s 1] [--token-s 0.01]

A real HTTP server process (stdlib ``ThreadingHTTPServer``) that "generates" with the tiny
PyTorch network of ``tiny_model.py``: one forward pass per token, a token per forward pass
plus ``token_s`` of sleep (a slower model's pace), deterministic text.

* ``POST /v1/completions`` ``{"prompt": str, "max_tokens": N, "token_s"?: S}`` → an OpenAI
  ``text_completion`` object, with ``compute_s`` (the forward passes' time). Between tokens it
  looks at the client's socket: a client that closed its connection ends the generation
  (counted as ``aborted``), as a server that notices its clients going away does.
* ``GET /health``: 503 while the model loads (``--boot-s`` more seconds, a slow load), then 200.
* ``GET /idle``: ``{"running": N}``; ``GET /metrics``: ``model_requests_running N`` (Prometheus
  text); ``GET /stats``: ``{"served", "aborted", "running", "pid"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support.tiny_model import TinyModel  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog".split()


class State:
    def __init__(self, token_s: float, boot_s: float):
        self.token_s = token_s
        self.model = TinyModel()
        self.model.load()
        self.ready_at = time.monotonic() + boot_s  # a slower model's load, after the real one
        self.lock = threading.Lock()
        self.running = self.served = self.aborted = 0


def client_gone(sock: socket.socket) -> bool:
    """True when the peer closed its side (readable with nothing to read)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class Handler(BaseHTTPRequestHandler):
    state: State
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out at once, as real servers do

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: object, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        s = self.state
        if self.path == "/health":
            ready = time.monotonic() >= s.ready_at
            self._send(200 if ready else 503, {"status": "ok" if ready else "loading"})
        elif self.path == "/idle":
            self._send(200, {"running": s.running})
        elif self.path == "/metrics":
            text = f"# TYPE model_requests_running gauge\nmodel_requests_running {s.running}\n"
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        elif self.path == "/stats":
            stats = {"served": s.served, "aborted": s.aborted, "running": s.running}
            self._send(200, {**stats, "pid": os.getpid()})
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        s = self.state
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            self._send(400, {"error": "the body is not JSON"})
            return
        if self.path != "/v1/completions":
            self._send(404, {"error": f"no route {self.path}"})
            return
        if time.monotonic() < s.ready_at:
            self._send(503, {"error": "the model is loading"})
            return
        with s.lock:
            s.running += 1
        try:
            self._complete(body)
        finally:
            with s.lock:
                s.running -= 1

    def _complete(self, body: dict) -> None:
        s = self.state
        prompt = str(body.get("prompt", ""))
        tokens = int(body.get("max_tokens", 8))
        token_s = float(body.get("token_s", s.token_s))
        words, compute_s = [], 0.0
        for i in range(tokens):
            if client_gone(self.connection):
                with s.lock:
                    s.aborted += 1
                self.close_connection = True
                return
            out = s.model.run({"x": [len(prompt), i], "steps": 1})
            compute_s += out["compute_s"]
            words.append(WORDS[int(abs(out["y"][0]) * 1000 + i) % len(WORDS)])
            if token_s:
                time.sleep(token_s)
        with s.lock:
            s.served += 1
        self._send(
            200,
            {
                "id": f"cmpl-{s.served}",
                "object": "text_completion",
                "model": "tiny-mlp",
                "choices": [{"index": 0, "text": " ".join(words), "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": tokens},
                "compute_s": compute_s,
                "pid": os.getpid(),
            },
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--boot-s", type=float, default=0.0)
    parser.add_argument("--token-s", type=float, default=0.0)
    parser.add_argument("--pidfile", default=None)
    args = parser.parse_args(argv)
    Handler.state = State(args.token_s, args.boot_s)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    if args.pidfile:
        Path(args.pidfile).write_text(str(os.getpid()))
    try:
        server.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
