"""A real HTTP server on 127.0.0.1 speaking a RunPod-like serverless job API, with fault knobs.

Routes (any endpoint id; ids are percent-decoded per path segment)::

    POST /v2/<endpoint>/run            {"input": ...}  -> {"id", "status": "IN_QUEUE"}
    GET  /v2/<endpoint>/status/<id>    -> {"id", "status", "delayTime", "executionTime", "output"?}
    GET  /v2/<endpoint>/result/<id>    -> {"data": [{"audio": ...}]}  (completed jobs only)
    POST /v2/<endpoint>/cancel/<id>    -> {"id", "status": "CANCELLED"}

Every request must carry ``authorization: <api_key>`` (else 401). Jobs move IN_QUEUE ->
IN_PROGRESS -> COMPLETED on the server's monotonic clock. Knobs (``server.knobs``) inject the
faults adapters must survive: 500s, slow answers (client timeouts), malformed JSON, missing
fields, a slow cancel, a cancel that never reaches a terminal state, odd job ids. A request may
force its job's fate: ``{"input": {"http_fake": {"queue_s", "run_s", "final_state"}}}``.

Billing truth (``server.truth()``, the shape of the other fakes' ``/admin/truth``): a job bills
from the end of its queue to its end or to its cancel taking effect (``billed_s``: the true
``executionTime``, whatever the ``execution_ms`` knob makes it report); a cancel that reaches a
queued job removes it (never started, 0 s); one acknowledged but never terminal stops nothing.
Refused cancels are counted against their job.

Usage::

    with HttpProviderServer() as server:
        server.knobs.status_errors = 2
        ... server.base_url("ep1") ...
"""

from __future__ import annotations

import base64
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast
from urllib.parse import unquote, urlsplit

from gpuhedge_celery.core.validators import tone_wav

GOOD_AUDIO = base64.b64encode(tone_wav(1.0)).decode("ascii")


@dataclass
class Knobs:
    """Behaviour of the fake provider; change fields between or during requests."""

    api_key: str = "test-key"
    queue_s: float = 0.05
    run_s: float = 0.1
    final_state: str = "COMPLETED"
    job_error: str = "worker crashed"  # a FAILED job's error text
    execution_ms: float | None = None  # report this executionTime instead of the real one
    output: Any = field(default_factory=lambda: {"audio_base64": GOOD_AUDIO})
    job_id_template: str = "job-{n}"
    submit_errors: int = 0  # the next N submits answer HTTP 500
    status_errors: int = 0  # the next N status calls answer HTTP 500
    submit_delay_s: float = 0.0  # sleep before answering (client read timeouts)
    status_delay_s: float = 0.0
    malformed: set[str] = field(default_factory=set)  # ops answering non-JSON: submit/status/cancel
    omit: set[str] = field(default_factory=set)  # response fields to drop: id, status, output
    state_override: str | None = None  # report this status string instead of the real one
    cancel_delay_s: float = 0.0  # the cancel reply is this slow
    cancel_terminal_after_s: float = 0.05  # a cancelled job shows CANCELLED after this
    cancel_never_terminal: bool = False  # cancel answers 200 CANCELLED; status never changes
    cancel_errors: int = 0  # the next N cancels answer HTTP 500
    error_status: int = 500  # the status those errors answer with (429: rate limited)
    cancel_error_status: int | None = None  # the status refused cancels answer (None: error_status)


@dataclass
class Job:
    id: str
    submitted: float
    input: Any
    queue_s: float
    run_s: float
    final_state: str
    cancelled_at: float | None = None  # server time the job became CANCELLED
    cancel_requested: float | None = None
    endpoint: str = ""
    cancel_refusals: int = 0  # cancels answered with an injected error

    def truth(self, now: float) -> dict[str, Any]:
        """What the provider bills for this job: its worker runs from the end of its queue to
        its end or its cancel's stop (what :meth:`state` reports as ``executionTime``)."""
        start, end = self.submitted + self.queue_s, self.submitted + self.queue_s + self.run_s
        stops = self.cancelled_at is not None and self.cancelled_at < end
        requested = self.cancel_requested
        queued_cancel = stops and requested is not None and requested < start
        started = None if queued_cancel else start
        queued_until = cast(float, requested) if queued_cancel else start
        ended_at = cast(float, self.cancelled_at) if stops else end
        billed = 0.0 if started is None else max(0.0, min(ended_at, now) - started)
        ran_on = requested is not None and not stops and requested < end  # never terminal
        ended = now >= ended_at
        return {
            "endpoint": self.endpoint,
            "submitted": self.submitted,
            "started": started,
            "queued_s": max(0.0, min(queued_until, now) - self.submitted),
            "stopped_by_cancel": stops,
            "ended": ended,
            "ended_at": ended_at if ended else None,
            "billed_s": billed,
            "cancel_requested_at": requested,
            "cancel_refusals": self.cancel_refusals,
            "late_result": ran_on,
            "status": self.state(now)[0],
        }

    def state(self, now: float) -> tuple[str, float, float]:
        """(status, delayTime ms, executionTime ms) at server time ``now``."""
        start, end = self.submitted + self.queue_s, self.submitted + self.queue_s + self.run_s
        if self.cancelled_at is not None and now >= self.cancelled_at and self.cancelled_at < end:
            if self.cancel_requested is not None and self.cancel_requested < start:
                return "CANCELLED", (self.cancel_requested - self.submitted) * 1000, 0.0
            return "CANCELLED", self.queue_s * 1000, (self.cancelled_at - start) * 1000
        if now >= end:
            return self.final_state, self.queue_s * 1000, self.run_s * 1000
        if now >= start and not (self.cancel_requested and self.cancel_requested < start):
            return "IN_PROGRESS", self.queue_s * 1000, (now - start) * 1000
        return "IN_QUEUE", (now - self.submitted) * 1000, 0.0


@dataclass
class Seen:
    method: str
    raw_path: str
    op: str
    job_id: str | None
    headers: dict[str, str]
    body: Any


class HttpProviderServer:
    """The fake provider, serving on a free loopback port from a background thread."""

    def __init__(self, knobs: Knobs | None = None):
        self.knobs = knobs or Knobs()
        self.jobs: dict[str, Job] = {}
        self.requests: list[Seen] = []
        self.lock = threading.Lock()
        self._n = 0
        handler = type("Handler", (_Handler,), {"server_state": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def base_url(self, endpoint: str = "ep1") -> str:
        return f"{self.url}/v2/{endpoint}"

    def truth(self) -> dict[str, dict[str, Any]]:
        """Every job's billing truth (:meth:`Job.truth`), by job id."""
        now = time.monotonic()
        with self.lock:
            return {job_id: job.truth(now) for job_id, job in self.jobs.items()}

    def ops(self, op: str) -> list[Seen]:
        return [r for r in self.requests if r.op == op]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> HttpProviderServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # --- behaviour --------------------------------------------------------------------------

    def handle(self, method: str, raw_path: str, headers: dict[str, str], body: Any):
        """Return (http status, body text) for one request."""
        k = self.knobs
        parts = [unquote(p) for p in urlsplit(raw_path).path.split("/") if p != ""]
        op, job_id = "unknown", None
        if len(parts) >= 3 and parts[0] == "v2":
            op = parts[2]
            job_id = parts[3] if len(parts) == 4 else None
        with self.lock:
            self.requests.append(Seen(method, raw_path, op, job_id, headers, body))
        if headers.get("authorization") != k.api_key:
            return 401, json.dumps({"error": "unauthorized"})
        if op == "run" and method == "POST":
            return self._run(parts[1], body)
        if op == "status" and method == "GET" and job_id is not None:
            return self._status(job_id)
        if op == "cancel" and method == "POST" and job_id is not None:
            return self._cancel(job_id)
        if op == "result" and method == "GET" and job_id is not None:
            return self._result(job_id)
        return 404, json.dumps({"error": f"no route {method} {raw_path}"})

    def _answer(self, op: str, data: dict[str, Any]) -> tuple[int, str]:
        if op in self.knobs.malformed:
            return 200, "{this is not json"
        for name in self.knobs.omit:
            data.pop(name, None)
        return 200, json.dumps(data)

    def _run(self, endpoint: str, body: Any) -> tuple[int, str]:
        k = self.knobs
        time.sleep(k.submit_delay_s)
        job_input = body.get("input") if isinstance(body, dict) else None
        forced = job_input.get("http_fake") if isinstance(job_input, dict) else None
        forced = forced if isinstance(forced, dict) else {}
        with self.lock:
            if k.submit_errors > 0:
                k.submit_errors -= 1
                return k.error_status, "internal error"
            self._n += 1
            job_id = k.job_id_template.format(n=self._n)
            self.jobs[job_id] = Job(
                job_id,
                time.monotonic(),
                job_input,
                float(forced.get("queue_s", k.queue_s)),
                float(forced.get("run_s", k.run_s)),
                str(forced.get("final_state", k.final_state)),
                endpoint=endpoint,
            )
        return self._answer("submit", {"id": job_id, "status": "IN_QUEUE"})

    def _status(self, job_id: str) -> tuple[int, str]:
        k = self.knobs
        time.sleep(k.status_delay_s)
        with self.lock:
            if k.status_errors > 0:
                k.status_errors -= 1
                return k.error_status, "upstream unavailable"
            job = self.jobs.get(job_id)
            if job is None:
                return 404, json.dumps({"error": f"no job {job_id}"})
            status, delay, execution = job.state(time.monotonic())
        data: dict[str, Any] = {
            "id": job_id,
            "status": k.state_override or status,
            "delayTime": round(delay),
            "executionTime": round(execution) if k.execution_ms is None else k.execution_ms,
        }
        if status == "COMPLETED":
            data["output"] = k.output
        elif status == "FAILED":
            data["error"] = k.job_error
        return self._answer("status", data)

    def _result(self, job_id: str) -> tuple[int, str]:
        """A separate result call, nesting the payload in a list (``data.0.audio``)."""
        with self.lock:
            job = self.jobs.get(job_id)
            if job is None or job.state(time.monotonic())[0] != "COMPLETED":
                return 404, json.dumps({"error": f"no result for {job_id}"})
        return self._answer("result", {"data": [{"audio": self.knobs.output["audio_base64"]}]})

    def _cancel(self, job_id: str) -> tuple[int, str]:
        k = self.knobs
        time.sleep(k.cancel_delay_s)
        with self.lock:
            job = self.jobs.get(job_id)
            if k.cancel_errors > 0:
                k.cancel_errors -= 1
                if job is not None:
                    job.cancel_refusals += 1
                code = k.error_status if k.cancel_error_status is None else k.cancel_error_status
                return code, "cancel failed"
            if job is None:
                return 404, json.dumps({"error": f"no job {job_id}"})
            now = time.monotonic()
            if job.cancel_requested is None:
                job.cancel_requested = now
                if not k.cancel_never_terminal:
                    job.cancelled_at = now + k.cancel_terminal_after_s
        return self._answer("cancel", {"id": job_id, "status": "CANCELLED"})


class _Handler(BaseHTTPRequestHandler):
    server_state: HttpProviderServer
    protocol_version = "HTTP/1.1"
    # headers and body go out as two writes: with Nagle on, each answer waits ~40 ms for the
    # client's delayed ACK
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass

    def _serve(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("latin-1")
        headers = {k.lower(): v for k, v in self.headers.items()}
        status, text = self.server_state.handle(self.command, self.path, headers, body)
        data = text.encode()
        try:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
            pass

    do_GET = _serve
    do_POST = _serve
