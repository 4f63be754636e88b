"""A loopback fake of RunPod Serverless's job API, in its own process (tests and benchmarks).

``python -m benchmarks.fakes.runpod_fake --port 0 --config '{...}'`` serves on 127.0.0.1
and prints ``READY <port>``; :class:`FakeRunpod` starts and drives one. Any endpoint id works:

=====================================  ===================================================
``POST /v2/<ep>/run``                  ``{input, policy?, webhook?}`` -> ``{id, status}``
``GET  /v2/<ep>/status/<id>``          ``{id, status, delayTime?, executionTime?, output?}``
``POST /v2/<ep>/cancel/<id>``          ``{id, status}`` (an acknowledgement only)
``GET  /v2/<ep>/health``               ``{jobs: {inQueue, inProgress, ...}, workers: {...}}``
``POST /graphql``                      the account API: ``myself { id clientBalance ... }``
                                       (:mod:`.runpod_fake_account`)
``GET  /admin/stats``                  per ``"<ep> <route>"``: requests, the most in any
                                       ``window_s`` window, 429s, injected faults; CPU
``POST /admin/config`` / ``/reset``    merge knobs / forget jobs, counters and changes
``GET  /admin/jobs/<ep>/<id>``         a job's true state; ``GET /admin/live``: jobs not ended
``GET  /admin/truth``                  every job's billing truth (:meth:`Job.truth`)
=====================================  ===================================================

Jobs go ``IN_QUEUE`` -> ``IN_PROGRESS`` -> ``COMPLETED`` (or the ``outcome``) on the server's
clock, each phase's length drawn from a distribution (a number, ``[low, high]`` uniform, or
``{"lognormal": {"median", "sigma"}}``) or forced by the request:
``{"runpod_fake": {"<ep>" or "*": {"queue_s", "run_s", "outcome", "output", "error"}}}``. A cancel
removes a queued job at once (0 ms execution) and stops a running one after ``cancel_stop_s``;
a job whose ``policy.executionTimeout`` (ms) is shorter than its run ends ``TIMED_OUT`` then.
A terminal job's result expires after ``result_ttl_s`` (404 afterwards, as RunPod's 30 min).
Requests over ``limits`` per ``window_s`` (sliding, per endpoint and route) get 429 with
``Retry-After``. ``faults.<route>``: ``errors_next`` / ``error_rate`` (HTTP ``error_code``),
``malformed_next`` / ``malformed_rate`` (a body that is not JSON), ``missing_next`` (a body
without ``status``), ``slow_next`` + ``slow_s`` (an answer that outlasts client timeouts).

A job submitted with a ``webhook`` gets the ``/status`` body POSTed there when it ends, tried
``webhook_attempts`` times ``webhook_gap_s`` apart (RunPod: 3 tries, 10 s apart), by
``webhook_senders`` threads (8; each waits for the receiver's answer);
``faults.webhook``: ``drop_next`` / ``drop_rate`` (never sent), ``malformed_next`` (a body that
is not JSON). ``/admin/stats`` counts them under ``webhooks``.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import random
import threading
import time
import uuid
from collections import deque
from typing import Any, cast
from urllib.parse import unquote, urlsplit

from . import ROOT, child_env
from .fake_process import FakeProcess, JsonHandler, serve_fake
from .runpod_fake_account import graphql
from .webhook_delivery import Deliverer

ROUTES = ("run", "status", "cancel", "health")
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT")


def default_config() -> dict[str, Any]:
    from gpuhedge_celery.core.validators import tone_wav

    return {
        "api_key": "test-key",
        "queue_s": [0.05, 0.2],
        "run_s": [0.1, 0.5],
        "outcome": "COMPLETED",
        "output": {"audio_base64": base64.b64encode(tone_wav(1.0)).decode("ascii")},
        "cancel_stop_s": [0.05, 0.15],
        "result_ttl_s": 1800.0,
        "window_s": 10.0,
        "limits": {"run": 1000, "status": 2000, "cancel": 100},
        "enforce_limits": True,
        "idle_workers": 0,
        "faults": {},
        "webhook_attempts": 3,
        "webhook_gap_s": 10.0,
        "webhook_senders": 8,
        "seed": 1,
    }


def draw(spec: Any, rng: random.Random) -> float:
    """A duration from its spec: a number, ``[low, high]``, or ``{"lognormal": {...}}``."""
    if isinstance(spec, (int, float)):
        return float(spec)
    if isinstance(spec, list) and len(spec) == 2:
        return rng.uniform(float(spec[0]), float(spec[1]))
    if isinstance(spec, dict) and "lognormal" in spec:
        p = spec["lognormal"]
        return float(p["median"]) * math.exp(rng.gauss(0.0, float(p.get("sigma", 0.5))))
    raise ValueError(f"not a duration: {spec!r}")


class Job:
    __slots__ = ("id", "ep", "submitted", "queue_s", "run_s", "outcome", "output",
                 "cancelled_at", "stop_at", "options", "cancel_refusals")  # fmt: skip

    def __init__(self, ep: str, submitted: float, queue_s: float, run_s: float, outcome: str,
                 output: Any):  # fmt: skip
        self.id = f"{uuid.uuid4().hex[:12]}-u1"
        self.ep, self.submitted, self.queue_s, self.run_s = ep, submitted, queue_s, run_s
        self.outcome, self.output = outcome, output
        self.cancelled_at: float | None = None
        self.stop_at: float | None = None
        self.options: dict[str, Any] = {}  # what came with the input: policy, webhook
        self.cancel_refusals = 0  # cancels answered with an injected fault or a 429

    def truth(self, now: float) -> dict[str, Any]:
        """What RunPod bills for this job: its worker runs from the end of its queue to its
        end or its cancel's stop (``billed_s``, the idle window apart); times are this
        server's monotonic seconds. ``billed_s`` is what ``executionTime`` reports."""
        start = self.submitted + self.queue_s
        end = start + self.run_s
        queued_cancel = self.cancelled_at is not None and self.cancelled_at < start
        stopped = self.stop_at is not None and self.stop_at < end
        if queued_cancel:
            started, ended_at = None, cast(float, self.cancelled_at)  # set: queued_cancel
        else:
            started = start
            ended_at = min(end, cast(float, self.stop_at)) if stopped else end
        ended = ended_at is not None and now >= ended_at
        billed = 0.0 if started is None else max(0.0, min(ended_at, now) - started)
        return {
            "endpoint": self.ep,
            "submitted": self.submitted,
            "started": started,
            "stopped_by_cancel": queued_cancel or stopped,
            "ended": ended,
            "ended_at": ended_at if ended else None,
            "billed_s": billed,
            "cancel_requested_at": self.cancelled_at,
            "cancel_refusals": self.cancel_refusals,
            "status": self.view(now)[0],
        }

    def view(self, now: float) -> tuple[str, float | None, float | None, float | None]:
        """(status, delayTime ms, executionTime ms, terminal since) at server time ``now``."""
        start = self.submitted + self.queue_s
        end = start + self.run_s
        if self.cancelled_at is not None and self.cancelled_at < start:
            delay = (self.cancelled_at - self.submitted) * 1000
            return "CANCELLED", delay, 0.0, self.cancelled_at
        if self.stop_at is not None and self.stop_at < end and now >= self.stop_at:
            return "CANCELLED", self.queue_s * 1000, (self.stop_at - start) * 1000, self.stop_at
        if now >= end:
            return self.outcome, self.queue_s * 1000, self.run_s * 1000, end
        if now >= start:
            return "IN_PROGRESS", self.queue_s * 1000, None, None
        return "IN_QUEUE", None, None, None


class Counter:
    """Requests of one endpoint and route: totals and the most in any sliding window."""

    __slots__ = ("count", "recent", "accepted", "max_window", "limited", "faults")

    def __init__(self) -> None:
        self.count = self.max_window = self.limited = self.faults = 0
        self.recent: deque[float] = deque()  # arrivals within the window
        self.accepted: deque[float] = deque()  # answered (not 429) within the window

    def arrive(self, now: float, window_s: float) -> None:
        self.count += 1
        for q in (self.recent, self.accepted):
            while q and q[0] <= now - window_s:
                q.popleft()
        self.recent.append(now)
        self.max_window = max(self.max_window, len(self.recent))

    def to_dict(self) -> dict[str, int]:
        return {"requests": self.count, "max_in_window": self.max_window,
                "limited_429": self.limited, "faults": self.faults}  # fmt: skip


class Fake:
    """The fake's state; every method is called under :attr:`lock`."""

    def __init__(self, config: dict[str, Any]):
        self.initial = dict(config)
        self.config = default_config()
        senders = int(config.get("webhook_senders", self.config["webhook_senders"]))
        self.deliverer = Deliverer(retry_5xx=True, threads=senders)  # fixed at start
        self.configure(config)
        self.lock = threading.Lock()
        self.jobs: dict[str, Job] = {}
        self.counters: dict[str, Counter] = {}

    def configure(self, changes: dict[str, Any]) -> None:
        for key, value in changes.items():
            if key in ("limits", "faults") and isinstance(value, dict):
                merged = dict(self.config.get(key) or {})
                merged.update(value)
                value = merged
            self.config[key] = value
        self.rng = random.Random(self.config.get("seed"))
        self.deliverer.attempts = int(self.config["webhook_attempts"])
        self.deliverer.gap_s = float(self.config["webhook_gap_s"])

    def reset(self) -> None:
        """Forget jobs and counters; knobs back to those the process started with."""
        self.jobs.clear()
        self.counters.clear()
        self.deliverer.clear()
        self.config = default_config()
        self.configure(self.initial)

    # --- the API ----------------------------------------------------------------------------
    def handle(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, Any, dict]:
        parts = [unquote(p) for p in urlsplit(path).path.split("/") if p]
        if parts[:1] == ["admin"]:
            return self.admin(method, parts[1:], body)
        if parts == ["graphql"]:
            return graphql(self, method, headers, body, time.monotonic())
        if len(parts) < 3 or parts[0] != "v2" or parts[2] not in ROUTES:
            return 404, {"error": "no such route"}, {}
        ep, route, job_id = parts[1], parts[2], parts[3] if len(parts) > 3 else None
        now = time.monotonic()
        counter = self.counters.setdefault(f"{ep} {route}", Counter())
        counter.arrive(now, float(self.config["window_s"]))
        if headers.get("authorization") != self.config["api_key"]:
            return 401, {"error": "unauthorized"}, {}
        limit = (self.config.get("limits") or {}).get(route)
        if self.config.get("enforce_limits") and limit and len(counter.accepted) >= limit:
            counter.limited += 1
            if route == "cancel" and job_id in self.jobs:
                self.jobs[job_id].cancel_refusals += 1
            wait = counter.accepted[0] + float(self.config["window_s"]) - now
            return 429, {"error": "rate limited"}, {"Retry-After": str(max(1, math.ceil(wait)))}
        counter.accepted.append(now)
        fault = self.fault(route)
        if fault is not None:
            counter.faults += 1
            if route == "cancel" and job_id in self.jobs:
                self.jobs[job_id].cancel_refusals += 1
            return fault
        if route == "run" and method == "POST":
            return self.run(ep, body, now)
        if route == "health":
            return self.health(ep, now)
        job = self.jobs.get(job_id or "")
        if job is None or job.ep != ep:
            return 404, {"error": "request does not exist"}, {}
        status, _, _, since = job.view(now)
        if since is not None and now - since > float(self.config["result_ttl_s"]):
            del self.jobs[job.id]  # expired, as RunPod forgets results after 30 min
            return 404, {"error": "request does not exist"}, {}
        if route == "cancel" and method == "POST":
            if status not in TERMINAL and job.cancelled_at is None:
                job.cancelled_at = now
                if status == "IN_PROGRESS":
                    job.stop_at = now + draw(self.config["cancel_stop_s"], self.rng)
            return 200, {"id": job.id, "status": "CANCELLED"}, {}
        if route == "status" and method == "GET":
            return 200, self.answer(job, now), {}
        return 405, {"error": "method not allowed"}, {}

    def fault(self, route: str) -> tuple[int, Any, dict] | None:
        f = (self.config.get("faults") or {}).get(route)
        if not f:
            return None
        for kind in ("errors", "malformed", "missing", "slow"):
            if f.get(f"{kind}_next", 0) > 0:
                f[f"{kind}_next"] -= 1
                break
        else:
            if self.rng.random() < float(f.get("error_rate", 0.0)):
                kind = "errors"
            elif self.rng.random() < float(f.get("malformed_rate", 0.0)):
                kind = "malformed"
            else:
                return None
        if kind == "errors":
            extra = {"Retry-After": str(f["retry_after"])} if "retry_after" in f else {}
            return int(f.get("error_code", 500)), {"error": "injected"}, extra
        if kind == "malformed":
            return 200, b'{"id": "x", "status": ', {}
        if kind == "missing":
            return 200, {"id": "x"}, {}
        if kind == "slow":
            return -1, float(f.get("slow_s", 5.0)), {}  # the handler sleeps, then answers 504
        return None

    def run(self, ep: str, body: bytes, now: float) -> tuple[int, Any, dict]:
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            return 400, {"error": "body is not JSON"}, {}
        if not isinstance(request, dict) or "input" not in request:
            return 400, {"error": "missing input"}, {}
        forced: dict[str, Any] = {}
        if isinstance(request["input"], dict):
            options = request["input"].get("runpod_fake") or {}
            forced = options.get(ep) or options.get("*") or {}
        c = self.config
        job = Job(
            ep, now,
            float(forced["queue_s"]) if "queue_s" in forced else draw(c["queue_s"], self.rng),
            float(forced["run_s"]) if "run_s" in forced else draw(c["run_s"], self.rng),
            forced.get("outcome", c["outcome"]), forced.get("output", c["output"]),
        )  # fmt: skip
        job.options = {k: v for k, v in request.items() if k != "input"}
        limit_ms = (job.options.get("policy") or {}).get("executionTimeout")
        if isinstance(limit_ms, (int, float)) and limit_ms / 1000.0 < job.run_s:
            job.run_s, job.outcome = limit_ms / 1000.0, "TIMED_OUT"  # RunPod stops it itself
        if "error" in forced:  # the text a FAILED job reports (a job may echo its input)
            job.options["_error"] = str(forced["error"])
        self.jobs[job.id] = job
        if isinstance(job.options.get("webhook"), str):
            self.deliverer.schedule(job.submitted + job.queue_s + job.run_s, self._hook(job))
        return 200, {"id": job.id, "status": "IN_QUEUE"}, {}

    def _hook(self, job: Job) -> Any:
        """The delivery of ``job``'s webhook: its /status body once it has ended."""

        def fire() -> Any:
            with self.lock:
                if self.jobs.get(job.id) is not job:
                    return None  # forgotten (reset)
                now = time.monotonic()
                status = job.view(now)[0]
                if status not in TERMINAL:
                    end = job.stop_at if job.stop_at is not None else (
                        job.submitted + job.queue_s + job.run_s)  # fmt: skip
                    return ("later", max(end, now + 0.001))
                body = self.answer(job, now)
                fault = self.webhook_fault()
            if fault == "drop":
                self.deliverer.count("dropped")
                return None
            data = b'{"id": "' if fault == "malformed" else json.dumps(body).encode()
            return ("send", job.options["webhook"], data)

        return fire

    def webhook_fault(self) -> str | None:
        f = (self.config.get("faults") or {}).get("webhook") or {}
        for kind in ("drop", "malformed"):
            if f.get(f"{kind}_next", 0) > 0:
                f[f"{kind}_next"] -= 1
                return kind
        if self.rng.random() < float(f.get("drop_rate", 0.0)):
            return "drop"
        return None

    def answer(self, job: Job, now: float) -> dict[str, Any]:
        status, delay, execution, _ = job.view(now)
        out: dict[str, Any] = {"id": job.id, "status": status}
        if delay is not None:
            out["delayTime"] = round(delay)
        if execution is not None:
            out["executionTime"] = round(execution)
        if status == "COMPLETED":
            out["output"] = job.output
        elif status in ("FAILED", "TIMED_OUT"):
            out["error"] = job.options.get("_error", f"job {status.lower()}")
        return out

    def health(self, ep: str, now: float) -> tuple[int, Any, dict]:
        counts = {"IN_QUEUE": 0, "IN_PROGRESS": 0, "COMPLETED": 0, "FAILED": 0}
        for job in self.jobs.values():
            if job.ep == ep:
                status = job.view(now)[0]
                counts[status] = counts.get(status, 0) + 1
        jobs = {
            "inQueue": counts["IN_QUEUE"],
            "inProgress": counts["IN_PROGRESS"],
            "completed": counts["COMPLETED"],
            "failed": counts["FAILED"],
            "retried": 0,
        }
        workers = {"idle": int(self.config["idle_workers"]), "running": counts["IN_PROGRESS"]}
        return 200, {"jobs": jobs, "workers": workers}, {}  # fmt: skip

    # --- admin ------------------------------------------------------------------------------
    def admin(self, method: str, parts: list[str], body: bytes) -> tuple[int, Any, dict]:
        now = time.monotonic()
        if parts == ["stats"]:
            routes = {k: c.to_dict() for k, c in sorted(self.counters.items())}
            return 200, {"routes": routes, "jobs": len(self.jobs), "cpu_s": time.process_time(),
                         "window_s": self.config["window_s"],
                         "webhooks": self.deliverer.stats()}, {}  # fmt: skip
        if parts == ["config"] and method == "POST":
            self.configure(json.loads(body or b"{}"))
            return 200, {"ok": True}, {}
        if parts == ["reset"] and method == "POST":
            self.reset()
            return 200, {"ok": True}, {}
        if parts == ["truth"]:
            return 200, {j.id: j.truth(now) for j in self.jobs.values()}, {}
        if parts == ["live"]:
            live = [j.id for j in self.jobs.values() if j.view(now)[0] not in TERMINAL]
            return 200, {"live": live}, {}
        if len(parts) == 3 and parts[0] == "jobs":
            job = self.jobs.get(parts[2])
            if job is None or job.ep != parts[1]:
                return 404, {"error": "no such job"}, {}
            seen = {"cancelled": job.cancelled_at is not None, "options": job.options}
            return 200, {**self.answer(job, now), **seen}, {}
        return 404, {"error": "no such admin route"}, {}


class _Handler(JsonHandler):
    timeout_body = {"error": "gateway timeout"}
    do_GET = do_POST = JsonHandler._serve


def serve(port: int, config: dict[str, Any]) -> None:
    serve_fake(_Handler, Fake(config), port)


class FakeRunpod(FakeProcess):
    """The fake in a child process: ``url``, ``base_url`` (``.../v2``) and admin calls."""

    def __init__(self, config: dict[str, Any] | None = None, *, ready_timeout_s: float = 20.0):
        super().__init__("benchmarks.fakes.runpod_fake", "the RunPod fake", config,
                         ready_timeout_s=ready_timeout_s, env=child_env(), cwd=ROOT)  # fmt: skip
        self.base_url = f"{self.url}/v2"

    def route(self, endpoint: str, route: str) -> dict[str, int]:
        empty = {"requests": 0, "max_in_window": 0, "limited_429": 0, "faults": 0}
        return self.stats()["routes"].get(f"{endpoint} {route}", empty)

    def job(self, endpoint: str, job_id: str) -> dict[str, Any] | None:
        found = self._admin.get(f"/admin/jobs/{endpoint}/{job_id}")
        return found.json() if found.status_code == 200 else None

    def live(self) -> list[str]:
        return self._admin.get("/admin/live").json()["live"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--config", default="{}", help="JSON knobs (see the module docstring)")
    args = parser.parse_args(argv)
    serve(args.port, json.loads(args.config))


if __name__ == "__main__":
    main()
