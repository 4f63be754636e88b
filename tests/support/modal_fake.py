"""A stand-in for Modal's servers: a loopback HTTP server holding spawned calls, with knobs.

For tests and simulations only. The client side, an SDK-shaped namespace that talks to this
server under the adapter's real SDK client, is :mod:`tests.support.modal_fake_sdk`; a config
selects it through the adapter's seam::

    modal:
      app: tts
      function: synthesize
      sdk: "tests.support.modal_fake_sdk:FakeModalClient"
      sdk_options: {url: "${MODAL_FAKE_URL}"}

Run it as its own process (``python -m tests.support.modal_fake`` prints ``READY <url>``;
:class:`FakeModalProcess`), so every Celery worker reaches the same calls, or in a thread
(:class:`FakeModalServer`). Each spawned call's fate is drawn at spawn from configurable
distributions (``start_s``: the cold start or queue, ``run_s``: the run) and an outcome:
``success``, ``remote_error``, ``user_exception``, ``function_timeout``, ``internal_failure``,
``expired`` (no output is kept), ``hang`` (never ends). A request may force its own fate with
``{"modal_fake": {"run_s": 5, "outcome": "remote_error", ...}}``.

Modal's semantics it keeps: a poll of a call without an outcome answers ``pending`` (queued and
running look the same); a remote failure names the exception (``RemoteError``,
``FunctionTimeoutError``, the function's own); an output gone answers ``expired``; a cancel
ends the input ``cancel_effect_s`` later as a terminated result (``cancelled_reads_as``:
``remote_error``, ``expired``, or ``pending`` for a Modal that never shows the end);
``terminate_containers=True`` is refused, as Modal refused it. Auth: when the knobs set
``token_id``/``token_secret``, calls must carry them, else ``AuthError``.

Billing truth (``GET /_control/truth``, ``truth()``): Modal bills a container's running
seconds, so each call's ``billed_s`` runs from the end of its ``start_s`` (queued, not billed)
to its end or to its cancel taking effect; a cancel that reaches a call still queued removes it
(never started, 0 s). Refused cancels (injected errors, ``terminate_containers``) are counted
against their call.

Knobs (``POST /_control/knobs``, or ``server.knobs`` in a thread) inject faults: slow calls
(``*_delay_s``: a spawn creates its call first, then answers late), the next N calls of an op
failing (``*_errors``), unknown functions, an error text that echoes the token.
"""

from __future__ import annotations

import base64
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from urllib.parse import unquote, urlsplit

from gpuhedge_celery.core.validators import tone_wav
from tests.support.processes import stop_process

GOOD_AUDIO = base64.b64encode(tone_wav(1.0)).decode("ascii")
OUTCOMES = (
    "success", "remote_error", "user_exception", "function_timeout", "internal_failure",
    "expired", "hang",
)  # fmt: skip
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Knobs:
    """Behaviour of the fake; distributions are a number, ``{"uniform": [a, b]}`` or
    ``{"lognormal": [median, sigma]}`` (seconds)."""

    seed: int = 1
    start_s: Any = 0.02
    run_s: Any = 0.1
    outcome: str = "success"
    output: Any = field(default_factory=lambda: {"audio_base64": GOOD_AUDIO})
    expire_after_s: float | None = None  # a completed call's output expires this much later
    cancel_effect_s: float = 0.05  # a cancelled input ends this much later
    cancelled_reads_as: str = "remote_error"  # or "expired", "pending" (the end never shows)
    known_functions: list[str] | None = None  # "app/function" or "app/Cls.method"; None: any
    token_id: str | None = None
    token_secret: str | None = None
    echo_token_in_errors: bool = False  # an auth error repeating the token (to be scrubbed)
    spawn_delay_s: float = 0.0
    poll_delay_s: float = 0.0
    cancel_delay_s: float = 0.0
    spawn_errors: int = 0  # the next N calls of the op answer 503 (InternalError)
    poll_errors: int = 0
    cancel_errors: int = 0
    cancel_error: str = "InternalError"  # what those cancels answer: it (503), or AuthError (401)
    # the workspace billing report: rows {description, environment_name, interval_start
    # (ISO UTC day), cost (USD text)}; the report gives the whole days within [start, end)
    billing: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Call:
    id: str
    target: str
    request: Any
    created: float
    start_s: float
    run_s: float
    outcome: str
    output: Any
    cancelled_at: float | None = None
    cancel_refusals: int = 0  # cancels answered with an injected error or refused outright

    @property
    def natural_end(self) -> float:
        return math.inf if self.outcome == "hang" else self.created + self.start_s + self.run_s

    def ended_at(self, effect_s: float) -> float:
        """Server time the input ends: its own end, or its cancel taking effect."""
        if self.cancelled_at is not None and self.cancelled_at + effect_s < self.natural_end:
            return self.cancelled_at + effect_s
        return self.natural_end

    def truth(self, now: float, knobs: Knobs) -> dict[str, Any]:
        """What Modal bills for this call: its running seconds, from the end of its queue to its
        end or its cancel's effect; a call cancelled while queued never starts (times: this
        server's monotonic seconds, the other fakes' shape)."""
        start = self.created + self.start_s
        ended_at = self.ended_at(knobs.cancel_effect_s)
        queued_cancel = self.cancelled_at is not None and self.cancelled_at < start
        queued_until = cast(float, self.cancelled_at) if queued_cancel else start
        stopped = not queued_cancel and ended_at < self.natural_end
        started = None if queued_cancel else start
        billed = 0.0 if started is None else max(0.0, min(ended_at, now) - started)
        ran_on = (  # a cancel reached it running, it finished before the cancel took effect
            self.cancelled_at is not None
            and not queued_cancel
            and not stopped
            and self.cancelled_at < self.natural_end
        )
        ended = now >= ended_at
        return {
            "target": self.target,
            "submitted": self.created,
            "started": started,
            "queued_s": max(0.0, min(queued_until, now) - self.created),
            "stopped_by_cancel": queued_cancel or stopped,
            "ended": ended,
            "ended_at": ended_at if ended else None,
            "billed_s": billed,
            "cancel_requested_at": self.cancelled_at,
            "cancel_refusals": self.cancel_refusals,
            "late_result": ran_on,
            "status": self.view(now, knobs)["status"],
        }

    def view(self, now: float, knobs: Knobs) -> dict[str, Any]:
        """What ``get(timeout=0)`` sees now (also the control view of the call)."""
        end = self.ended_at(knobs.cancel_effect_s)
        if now < end:
            return {"status": "pending"}
        if end < self.natural_end:  # ended by its cancel: a terminated input
            reads = knobs.cancelled_reads_as
            if reads == "pending":
                return {"status": "pending"}
            if reads == "expired":
                return {"status": "expired"}
            return {"status": "failure", "type": "RemoteError", "message": "Input was cancelled"}
        if self.outcome == "expired" or (
            knobs.expire_after_s is not None and now >= end + knobs.expire_after_s
        ):
            return {"status": "expired"}
        if self.outcome == "success":
            return {"status": "success", "output": self.output}
        kinds = {
            "remote_error": ("RemoteError", "container crashed"),
            "user_exception": ("ValueError", "bad input: no text"),
            "function_timeout": ("FunctionTimeoutError", "Function timed out"),
            "internal_failure": ("InternalFailure", "internal failure"),
        }
        kind, message = kinds[self.outcome]
        return {"status": "failure", "type": kind, "message": message}


def draw(spec: Any, rng: random.Random) -> float:
    """One draw (seconds) from a distribution spec (see :class:`Knobs`)."""
    if isinstance(spec, (int, float)):
        return float(spec)
    if isinstance(spec, dict) and "uniform" in spec:
        low, high = spec["uniform"]
        return rng.uniform(float(low), float(high))
    if isinstance(spec, dict) and "lognormal" in spec:
        median, sigma = spec["lognormal"]
        return float(median) * math.exp(rng.gauss(0.0, float(sigma)))
    raise ValueError(f"bad distribution {spec!r}")


class FakeModalState:
    """Calls, knobs and request counts, shared by the server's handler threads."""

    def __init__(self, knobs: Knobs | None = None):
        self.knobs = knobs or Knobs()
        self.lock = threading.Lock()
        self.calls: dict[str, Call] = {}
        self.counts: dict[str, int] = {"spawn": 0, "poll": 0, "cancel": 0}
        self.rng = random.Random(self.knobs.seed)

    def spawn(self, body: dict[str, Any]) -> Call:
        k = self.knobs
        args = body.get("args") or [None]
        request = args[0]
        forced = request.get("modal_fake", {}) if isinstance(request, dict) else {}
        with self.lock:
            call = Call(
                id=f"fc-{uuid.uuid4().hex[:20]}",
                target=body["target"],
                request=request,
                created=time.monotonic(),
                start_s=float(forced.get("start_s", draw(k.start_s, self.rng))),
                run_s=float(forced.get("run_s", draw(k.run_s, self.rng))),
                outcome=str(forced.get("outcome", k.outcome)),
                output=forced.get("output", k.output),
            )
            if call.outcome not in OUTCOMES:
                raise ValueError(f"unknown outcome {call.outcome!r}")
            self.calls[call.id] = call
        return call

    def take_error(self, op: str) -> bool:
        with self.lock:
            left = getattr(self.knobs, f"{op}_errors")
            if left > 0:
                setattr(self.knobs, f"{op}_errors", left - 1)
                return True
            return False

    def truth(self) -> dict[str, dict[str, Any]]:
        """Every call's billing truth (:meth:`Call.truth`), by call id."""
        now = time.monotonic()
        with self.lock:
            return {c.id: c.truth(now, self.knobs) for c in self.calls.values()}

    def refused(self, call_id: str) -> None:
        """Count a refused cancel against its call (the truth's ``cancel_refusals``)."""
        with self.lock:
            call = self.calls.get(call_id)
            if call is not None:
                call.cancel_refusals += 1

    def control(self) -> dict[str, Any]:
        now = time.monotonic()
        with self.lock:
            calls = {
                c.id: {
                    **self.calls[c.id].view(now, self.knobs),
                    "target": c.target,
                    "cancelled": c.cancelled_at is not None,
                    "ended": now >= c.ended_at(self.knobs.cancel_effect_s),
                    "request": c.request,
                }
                for c in self.calls.values()
            }
            return {"calls": calls, "counts": dict(self.counts), "knobs": asdict(self.knobs)}


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, data: Any) -> None:
        body = json.dumps(data).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, kind: str, message: str) -> None:
        self._send(code, {"error": {"type": kind, "message": message}})

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("content-length") or 0)
        return json.loads(self.rfile.read(length) or b"{}") if length else {}

    def _authorised(self) -> bool:
        k = self.server.state.knobs
        token_id = self.headers.get("x-modal-token-id")
        secret = self.headers.get("x-modal-token-secret")
        if k.token_id is None or (token_id == k.token_id and secret == k.token_secret):
            return True
        shown = f" {token_id!r}" if k.echo_token_in_errors else ""
        self._error(401, "AuthError", f"Token ID{shown} is malformed or invalid")
        return False

    def do_GET(self) -> None:  # noqa: N802
        self._route("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")

    def _route(self, method: str) -> None:
        state = self.server.state
        parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
        body = self._body() if method == "POST" else {}
        if parts[0] == "_control":
            if method == "GET" and parts[1:] == ["truth"]:
                return self._send(200, state.truth())
            if method == "POST" and parts[1:] == ["knobs"]:
                with state.lock:
                    for key, value in body.items():
                        if not hasattr(state.knobs, key):
                            return self._error(400, "InvalidError", f"no knob {key!r}")
                        setattr(state.knobs, key, value)
            return self._send(200, state.control())
        if not self._authorised():
            return None
        if method == "POST" and parts == ["v1", "spawn"]:
            return self._spawn(body)
        if len(parts) == 3 and parts[:2] == ["v1", "calls"] and method == "GET":
            return self._poll(parts[2])
        if len(parts) == 4 and parts[:2] == ["v1", "calls"] and parts[3] == "cancel":
            return self._cancel(parts[2], body)
        if parts[:2] == ["v1", "lookup"] and method == "GET":  # hydrate: an authenticated read
            known, target = state.knobs.known_functions, "/".join(parts[2:])
            if known is not None and target not in known:
                return self._error(404, "NotFoundError", f"Lookup failed for {target!r}")
            return self._send(200, {"object_id": f"fu-{abs(hash(target)) % 10**8}"})
        if parts == ["v1", "billing"] and method == "GET":
            query = dict(p.split("=", 1) for p in urlsplit(self.path).query.split("&") if p)
            start, end = unquote(query["start"])[:10], unquote(query.get("end", "9999"))
            rows = [r for r in state.knobs.billing if start <= r["interval_start"][:10]]
            return self._send(200, [r for r in rows if r["interval_start"][:10] < end[:10]])
        return self._error(404, "NotFoundError", f"no route {method} {self.path}")

    def _spawn(self, body: dict[str, Any]) -> None:
        state = self.server.state
        with state.lock:
            state.counts["spawn"] += 1
        if state.take_error("spawn"):
            return self._error(503, "InternalError", "simulated server error")
        known = state.knobs.known_functions
        if known is not None and body.get("target") not in known:
            app, _, name = str(body.get("target")).partition("/")
            message = f"Lookup failed for Function '{name}' from the '{app}' app"
            return self._error(404, "NotFoundError", message)
        try:
            call = state.spawn(body)
        except ValueError as e:
            return self._error(400, "InvalidError", str(e))
        time.sleep(state.knobs.spawn_delay_s)  # the call exists; its reply is late
        return self._send(200, {"object_id": call.id})

    def _poll(self, call_id: str) -> None:
        state = self.server.state
        with state.lock:
            state.counts["poll"] += 1
        time.sleep(state.knobs.poll_delay_s)
        if state.take_error("poll"):
            return self._error(503, "InternalError", "simulated server error")
        with state.lock:
            call = state.calls.get(call_id)
            view = call.view(time.monotonic(), state.knobs) if call else None
        if view is None:
            return self._error(404, "NotFoundError", f"Function call {call_id!r} not found")
        return self._send(200, view)

    def _cancel(self, call_id: str, body: dict[str, Any]) -> None:
        state = self.server.state
        with state.lock:
            state.counts["cancel"] += 1
        time.sleep(state.knobs.cancel_delay_s)
        if state.take_error("cancel"):
            state.refused(call_id)
            kind = state.knobs.cancel_error
            return self._error(401 if kind == "AuthError" else 503, kind, "simulated refusal")
        if body.get("terminate_containers"):
            state.refused(call_id)
            return self._error(400, "InvalidError", "terminate_containers is not supported")
        with state.lock:
            call = state.calls.get(call_id)
            if call is not None and call.cancelled_at is None:
                call.cancelled_at = time.monotonic()
        if call is None:
            return self._error(404, "NotFoundError", f"Function call {call_id!r} not found")
        return self._send(200, {})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: FakeModalState


class FakeModalServer:
    """The fake on 127.0.0.1 in a thread of this process (``with FakeModalServer() as s``)."""

    def __init__(self, knobs: Knobs | None = None, port: int = 0):
        self.httpd = _Server(("127.0.0.1", port), _Handler)
        self.httpd.state = FakeModalState(knobs)
        # a short poll so that stopping does not wait out serve_forever's default half second
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    @property
    def knobs(self) -> Knobs:
        return self.httpd.state.knobs

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def control(self) -> dict[str, Any]:
        return self.httpd.state.control()

    def truth(self) -> dict[str, dict[str, Any]]:
        return self.httpd.state.truth()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FakeModalServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class FakeModalProcess:
    """The fake in its own process (``python -m tests.support.modal_fake``), driven over HTTP."""

    def __init__(self, log_path: Path | None = None):
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.modal_fake"],
            cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        line = self.process.stdout.readline() if self.process.stdout else ""
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"the fake Modal server did not start: {line!r}")
        self.url = line.split()[1]

    def set_knobs(self, **knobs: Any) -> dict[str, Any]:
        return _post(f"{self.url}/_control/knobs", knobs)

    def control(self) -> dict[str, Any]:
        return _post(f"{self.url}/_control/knobs", {})

    def truth(self) -> dict[str, dict[str, Any]]:
        """Every call's billing truth (``GET /_control/truth``), by call id."""
        import httpx

        response = httpx.get(f"{self.url}/_control/truth", timeout=10)
        response.raise_for_status()
        return response.json()

    def stop(self) -> None:
        stop_process(self.process)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    response = httpx.post(url, json=body, timeout=10)
    response.raise_for_status()
    return response.json()


def main() -> None:
    server = FakeModalServer()
    print(f"READY {server.url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
