"""The ``server:`` runner: each job is one HTTP request to a model server on the GPU host.

    GPUHEDGE_RUNNER='server:http://127.0.0.1:8000/v1/completions;timeout=120;idle=http://127.0.0.1:8000/metrics;idle_metric=vllm:num_requests_running'

The request (any JSON value) is POSTed as the JSON body to ``URL``; the answer's JSON (or text)
is the job's result. That is the whole protocol, so an OpenAI-compatible server (vLLM, TGI,
llama.cpp's ``llama-server``, Ollama's ``/v1``) takes an OpenAI request body as the pooled
request, and any plain HTTP model server works the same way. Options, after ``;``:

``timeout=S`` (300)
    per-request bound: a server that has not answered by then fails the job (``RunnerFailed``).
``ready=URL`` (the URL's origin + ``/health``)
    readiness probe: any 2xx means ready. The GPU worker's main process probes it and keeps the
    GPU out of the pool while it fails (``tasks/model_server.py``).
``idle=URL``, ``idle_metric=NAME`` (``running``)
    how the server says it is idle: a JSON object whose field NAME is 0 (or false), or Prometheus
    text whose NAME samples sum to 0 (vLLM: ``/metrics``, ``vllm:num_requests_running``).
``drain=S`` (5)
    after an aborted request, the longest wait for the server to be idle (without ``idle=``, the
    whole of it) before the worker takes its next job or releases the lease.
``boot=S`` (600)
    how long a server the worker started may take to become ready before it is restarted.

When the job's lease is lost (or the request is cancelled), the in-flight request is aborted by
closing its connection (a server that notices its client going away stops generating; for one
that does not, the wait that follows covers it), then the runner waits for the server to be
idle, at most ``drain`` seconds, and raises ``RunnerStopped``.
A server that refuses the connection, or answers 503, raises ``RunnerUnavailable``: the worker
frees the lease at once and the request waits for a GPU again.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, cast
from urllib.parse import urlsplit

from .errors import ConfigError
from .run_context import RunContext, RunnerFailed, RunnerStopped, RunnerUnavailable

WATCH_S = 0.02  # how often the abort watcher looks at the stop flag and the deadline
PROBE_TIMEOUT_S = 2.0


def _check_url(url: str, key: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"expected an http:// or https:// URL, got {url!r}", key=key)
    return url


def _positive(value: str, key: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"expected a number of seconds, got {value!r}", key=key) from None
    if not number > 0:
        raise ConfigError(f"expected a value > 0, got {value!r}", key=key)
    return number


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = cast(str, parts.hostname)  # _check_url refused a URL without one
    return cls(host, parts.port, timeout=timeout_s), path


def http_get(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[int, str]:
    """``GET url``: (status, body text); OSError when nothing answers."""
    conn, path = _connection(url, timeout_s)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    finally:
        conn.close()


def idle_value(body: str, metric: str) -> float | None:
    """How busy the server says it is: field ``metric`` of a JSON object, or the sum of the
    ``metric`` samples of Prometheus text; None when the answer does not say."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        value = data.get(metric)
        return float(value) if isinstance(value, (int, float)) else None
    total, found = 0.0, False
    for line in body.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == metric:
            try:
                total += float(line.rsplit(" ", 1)[1])
                found = True
            except (IndexError, ValueError):
                continue
    return total if found else None


@dataclass(frozen=True)
class ServerRunner:
    """Sends each job to a local model server (see the module docstring)."""

    url: str
    timeout_s: float = 300.0
    ready_url: str = ""
    idle_url: str | None = None
    idle_metric: str = "running"
    drain_s: float = 5.0
    boot_s: float = 600.0
    spec: str = ""

    @classmethod
    def parse(cls, text: str, spec: str | None = None) -> ServerRunner:
        """``URL[;timeout=S][;ready=URL][;idle=URL][;idle_metric=NAME][;drain=S][;boot=S]``."""
        url, *options = [part.strip() for part in text.split(";")]
        runner = cls(_check_url(url, "server"), spec=spec or f"server:{text}")
        for option in filter(None, options):
            key, sep, value = option.partition("=")
            if not sep or not value:
                raise ConfigError(f"expected key=value, got {option!r}", key="server")
            if key in ("timeout", "drain", "boot"):
                seconds: dict[str, Any] = {f"{key}_s": _positive(value, f"server {key}")}
                runner = replace(runner, **seconds)
            elif key in ("ready", "idle"):
                field = "ready_url" if key == "ready" else "idle_url"
                url_field: dict[str, Any] = {field: _check_url(value, f"server {key}")}
                runner = replace(runner, **url_field)
            elif key == "idle_metric":
                runner = replace(runner, idle_metric=value)
            else:
                raise ConfigError(
                    f"unknown option {key!r} (expected timeout, ready, idle, idle_metric, "
                    "drain or boot)",
                    key="server",
                )
        if not runner.ready_url:
            parts = urlsplit(runner.url)
            runner = replace(runner, ready_url=f"{parts.scheme}://{parts.netloc}/health")
        return runner

    # -- probes (the supervisor in the worker's main process, and after an abort) -------------
    def probe_ready(self) -> tuple[bool, str]:
        """(ready, why not): a 2xx from the readiness URL."""
        try:
            status, body = http_get(self.ready_url)
        except OSError as e:
            return False, f"{self.ready_url} does not answer ({e})"
        if 200 <= status < 300:
            return True, ""
        return False, f"{self.ready_url} answered {status}: {body.strip()[:120]}"

    def is_idle(self) -> bool | None:
        """Whether the server says it runs nothing (None: it cannot say, no ``idle=`` URL)."""
        if self.idle_url is None:
            return None
        try:
            status, body = http_get(self.idle_url)
        except OSError:
            return False
        value = idle_value(body, self.idle_metric) if status == 200 else None
        return value is not None and value == 0

    def await_idle(self) -> float:
        """After an abort: wait until the server is idle, at most ``drain_s``; seconds waited."""
        started = time.monotonic()
        deadline = started + self.drain_s
        while time.monotonic() < deadline:
            if self.is_idle():
                break
            time.sleep(0.05)
        return time.monotonic() - started

    # -- one job ------------------------------------------------------------------------------
    def run(self, request: Any, ctx: RunContext) -> Any:
        body = json.dumps(request).encode()
        conn, path = _connection(self.url, self.timeout_s)
        done = threading.Event()
        why: dict[str, str] = {}

        def watch() -> None:
            deadline = time.monotonic() + self.timeout_s
            while not done.is_set():
                if "reason" in why or ctx.stop.wait(WATCH_S) or time.monotonic() >= deadline:
                    why.setdefault("reason", "stopped" if ctx.stop.is_set() else "timeout")
                    _abort(conn)  # again until the request gives up (it may not be sent yet)
                    done.wait(WATCH_S)

        watcher = threading.Thread(target=watch, name="gpuhedge-server-abort", daemon=True)
        watcher.start()
        try:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            status, text = response.status, response.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException) as e:
            reason = why.get("reason")
            if reason == "stopped":
                waited = self.await_idle()
                raise RunnerStopped(
                    f"request to {self.url} on GPU {ctx.gpu_id!r} aborted: its lease was lost "
                    f"(server idle after {waited:.2f} s)"
                ) from None
            if reason == "timeout" or isinstance(e, TimeoutError):
                raise RunnerFailed(f"{self.url} did not answer within {self.timeout_s:g} s") from e
            if isinstance(e, ConnectionError | socket.gaierror):
                raise RunnerUnavailable(f"model server {self.url} is not answering: {e}") from e
            raise RunnerFailed(f"request to {self.url} failed: {type(e).__name__}: {e}") from e
        finally:
            done.set()
            conn.close()
        if status == 503:
            raise RunnerUnavailable(f"model server {self.url} is not ready (503)")
        if not 200 <= status < 300:
            raise RunnerFailed(f"{self.url} answered {status}: {text.strip()[:200]}")
        ctx.check()  # fencing: an answer that arrived after the lease was lost is not returned
        try:
            return json.loads(text)
        except ValueError:
            return text


def _abort(conn: http.client.HTTPConnection) -> None:
    """Close the request's connection from another thread: its blocked read fails at once."""
    sock = conn.sock
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
