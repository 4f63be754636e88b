"""A loopback provider fake in a child process, driven over its ``/admin/`` routes.

The fakes (the RunPod one here in ``benchmarks/fakes/``, the Cerebrium one in the tests) run as
``python -m <module> --port 0 --config '<JSON knobs>'``: :func:`serve_fake` answers with a
:class:`JsonHandler` subclass and prints ``READY <port>`` once listening; :class:`FakeProcess`
starts one, waits for that line and talks to its admin API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

F = TypeVar("F", bound="FakeProcess")


class FakeProcess:
    """``url`` (``http://127.0.0.1:<port>``), ``port``, ``pid`` and the admin calls."""

    def __init__(
        self,
        module: str,
        what: str,
        config: dict[str, Any] | None,
        *,
        ready_timeout_s: float,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ):
        """Start ``module``; ``what`` names the fake in the error raised when it does not
        start within ``ready_timeout_s``; ``env`` replaces the environment (default: this
        process's), with ``PYTHONUNBUFFERED`` set either way."""
        env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", module, "--port", "0", "--config", json.dumps(config or {})]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, cwd=cwd,
                                        start_new_session=True, text=True)  # fmt: skip
        deadline = time.monotonic() + ready_timeout_s
        line = ""
        while time.monotonic() < deadline and not line.startswith("READY"):
            line = self.process.stdout.readline() if self.process.stdout else ""
            if not line and self.process.poll() is not None:
                break
        if not line.startswith("READY"):
            self.stop()
            raise RuntimeError(f"{what} did not start")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        import httpx

        self._admin = httpx.Client(base_url=self.url, timeout=10.0)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stats(self) -> dict[str, Any]:
        return self._admin.get("/admin/stats").json()

    def truth(self) -> dict[str, dict[str, Any]]:
        """Every job's billing truth as the fake keeps it (``GET /admin/truth``): job id ->
        submitted, started (None: never left the queue), stopped_by_cancel, ended_at, billed_s."""
        return self._admin.get("/admin/truth").json()

    def configure(self, **changes: Any) -> None:
        self._admin.post("/admin/config", json=changes).raise_for_status()

    def reset(self) -> None:
        self._admin.post("/admin/reset").raise_for_status()

    def stop(self) -> None:
        if getattr(self, "_admin", None) is not None:
            self._admin.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        if self.process.stdout:
            self.process.stdout.close()

    def __enter__(self: F) -> F:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class JsonHandler(BaseHTTPRequestHandler):
    """Answers each request with ``fake.handle(method, path, headers, body)`` (under
    ``fake.lock``): ``(code, payload, extra headers)``, the payload sent as JSON unless it is
    bytes already. Code -1 is an injected slow answer: sleep ``payload`` seconds (outlasting
    the client's timeout), then answer 504 with ``timeout_body``. Subclasses set ``fake``,
    ``timeout_body`` and the ``do_<METHOD>`` they serve (``= _serve``)."""

    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse their connections
    # Headers and body leave in two writes: with Nagle's algorithm on, the body waits for the
    # client's delayed ACK (~40 ms a request), which no real API adds.
    disable_nagle_algorithm = True
    fake: Any
    timeout_body: dict[str, Any]

    def answer(self, body: bytes) -> tuple[int, Any, dict[str, str]]:
        return self.fake.handle(self.command, self.path, self.headers, body)

    def _serve(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        with self.fake.lock:
            code, payload, extra = self.answer(body)
        if code == -1:
            time.sleep(payload)
            code, payload, extra = 504, self.timeout_body, {}
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in extra.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:  # quiet
        pass


def serve_fake(handler: type[JsonHandler], fake: Any, port: int) -> None:
    """Serve ``fake`` on 127.0.0.1:``port`` (0: any free port) until killed, printing
    ``READY <port>`` once listening."""
    bound = type("Handler", (handler,), {"fake": fake})
    httpd = ThreadingHTTPServer(("127.0.0.1", port), bound)
    httpd.daemon_threads = True
    print(f"READY {httpd.server_address[1]}", flush=True)
    httpd.serve_forever(poll_interval=0.2)
