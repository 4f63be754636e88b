"""A loopback fake of Cerebrium's async-run API, in its own process (tests).

``python -m tests.support.cerebrium_fake --port 0 --config '{...}'`` prints ``READY <port>``;
:class:`FakeCerebrium` starts and drives one.

=========================================================  ====================================
``POST /v4/<project>/<app>/<fn>?async=true&webhookEndpoint=``  -> ``202 {"run_id"}``; the run
                                                               ends after ``queue_s + run_s``
                                                               and its response body
                                                               (``{"result": output}``, or
                                                               ``{"error"}`` when it fails) is
                                                               POSTed to the webhook
``DELETE /v2/projects/<p>/apps/<app_id>/runs/<id>``        ``200`` (an acknowledgement); a
                                                               queued run never starts; a
                                                               running one stops, or with
                                                               ``finish_after_cancel`` still
                                                               finishes and posts its webhook
``GET /v2/projects/<p>/apps/<app_id>``                     the app (``{"id", "status"}``) when
                                                               ``app_id`` is one of ``apps``,
                                                               else ``404`` (route ``app``)
``GET /admin/stats``, ``POST /admin/config`` / ``reset``   counters (routes, webhooks), knobs
``GET /admin/runs/<id>``                                   a run's true state
``GET /admin/truth``                                       every run's billing truth
=========================================================  ====================================

The inference route takes ``api_key`` as its bearer token; the management routes take
``rest_token`` when it is set (a service account's token), else ``api_key``.
Webhooks are tried ``webhook_attempts`` (3) times ``webhook_gap_s`` (5 s) apart and never
after a 5xx, as Cerebrium does. Fates per request: ``{"cerebrium_fake": {"queue_s", "run_s",
"outcome": "COMPLETED"|"FAILED", "output", "finish_after_cancel"}}``. Faults:
``limits: {"submit"|"cancel"|"app": n}`` per ``window_s`` (429 past it);
``faults.submit|cancel|app``: ``errors_next`` (``error_code``, ``error_message``),
``slow_next`` + ``slow_s``, ``malformed_next``; ``faults.webhook``: ``drop_next`` /
``drop_rate``, ``malformed_next``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
import uuid
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from benchmarks.fakes.fake_process import FakeProcess, JsonHandler, serve_fake
from benchmarks.fakes.runpod_fake import draw
from benchmarks.fakes.webhook_delivery import Deliverer

KEY = "cb-test-key-0123456789-very-secret"


def default_config() -> dict[str, Any]:
    import base64

    from gpuhedge_celery.core.validators import tone_wav

    return {
        "api_key": KEY,
        "queue_s": [0.05, 0.2],
        "run_s": [0.1, 0.5],
        "outcome": "COMPLETED",
        "output": {"audio_base64": base64.b64encode(tone_wav(1.0)).decode("ascii")},
        "finish_after_cancel": False,
        "webhook_attempts": 3,
        "webhook_gap_s": 5.0,
        "apps": {"p-test-tts": "ready"},  # app id -> status (the management API's GET)
        "limits": {},  # route -> requests per window_s, answered 429 past it
        "window_s": 10.0,
        "faults": {},
        "seed": 3,
    }


class Run:
    __slots__ = ("id", "submitted", "start", "end", "outcome", "output", "webhook",
                 "cancelled_at", "finish_after_cancel", "body", "cancel_refusals")  # fmt: skip

    def truth(self, now: float) -> dict[str, Any]:
        """What Cerebrium bills for this run: from its start to its end, or to the cancel that
        stopped it (``finish_after_cancel``: a cancelled running run runs on to its end and
        still posts its result, a late result); a run cancelled while queued never starts."""
        queued_cancel = self.cancelled_at is not None and self.cancelled_at < self.start
        stopped = (
            self.cancelled_at is not None
            and not queued_cancel
            and not self.finish_after_cancel
            and self.cancelled_at < self.end
        )
        if queued_cancel:
            started, ended_at = None, self.cancelled_at
        else:
            started, ended_at = self.start, self.cancelled_at if stopped else self.end
        ended = now >= ended_at
        billed = 0.0 if started is None else max(0.0, min(ended_at, now) - started)
        late = (
            self.cancelled_at is not None
            and not queued_cancel
            and not stopped
            and self.cancelled_at < self.end
        )
        return {
            "submitted": self.submitted,
            "started": started,
            "stopped_by_cancel": queued_cancel or stopped,
            "ended": ended,
            "ended_at": ended_at if ended else None,
            "billed_s": billed,
            "cancel_requested_at": self.cancelled_at,
            "cancel_refusals": self.cancel_refusals,
            "late_result": late,
            "status": self.state(now),
        }

    def state(self, now: float) -> str:
        if self.cancelled_at is not None and not (
            self.finish_after_cancel and self.cancelled_at >= self.start
        ):
            return "CANCELLED"
        if now >= self.end:
            return self.outcome
        return "RUNNING" if now >= self.start else "QUEUED"


class Fake:
    def __init__(self, config: dict[str, Any]):
        self.initial = dict(config)
        self.lock = threading.Lock()
        self.deliverer = Deliverer(retry_5xx=False)
        self.reset()

    def reset(self) -> None:
        self.runs: dict[str, Run] = {}
        self.counts: dict[str, int] = {}
        self.recent: dict[str, list[float]] = {}
        self.deliverer.clear()
        self.config = default_config()
        self.configure(self.initial)

    def configure(self, changes: dict[str, Any]) -> None:
        self.config.update(changes)
        self.rng = random.Random(self.config.get("seed"))
        self.deliverer.attempts = int(self.config["webhook_attempts"])
        self.deliverer.gap_s = float(self.config["webhook_gap_s"])

    def fault(self, route: str) -> tuple[int, Any] | None:
        f = (self.config.get("faults") or {}).get(route) or {}
        for kind in ("errors", "slow", "malformed", "drop"):
            if f.get(f"{kind}_next", 0) > 0:
                f[f"{kind}_next"] -= 1
                return kind, f
        if route == "webhook" and self.rng.random() < float(f.get("drop_rate", 0.0)):
            return "drop", f
        return None

    def handle(self, method: str, path: str, headers: Any, body: bytes) -> tuple[int, Any]:
        url = urlsplit(path)
        parts = [unquote(p) for p in url.path.split("/") if p]
        if parts[:1] == ["admin"]:
            return self.admin(method, parts[1:], body)
        route = "submit" if parts[:1] == ["v4"] else "cancel" if parts[:1] == ["v2"] else "?"
        if route == "cancel" and method == "GET":
            route = "app"
        self.counts[route] = self.counts.get(route, 0) + 1
        key = self.config.get("rest_token") if route != "submit" else None
        if headers.get("authorization") != f"Bearer {key or self.config['api_key']}":
            return 401, {"message": "Unauthorized"}
        now = time.monotonic()
        limit = (self.config.get("limits") or {}).get(route)
        if limit:
            window = float(self.config["window_s"])
            recent = [t for t in self.recent.get(route, []) if t > now - window]
            if len(recent) >= int(limit):
                self.counts["limited_429"] = self.counts.get("limited_429", 0) + 1
                self._refused(route, parts)
                return 429, {"message": "Too many requests"}
            self.recent[route] = [*recent, now]
        found = self.fault(route)
        if found is not None:
            kind, f = found
            self._refused(route, parts)
            if kind == "errors":
                return int(f.get("error_code", 500)), {"message": f.get("error_message",
                                                                      "injected")}  # fmt: skip
            if kind == "slow":
                return -1, float(f.get("slow_s", 5.0))
            if kind == "malformed":
                return 202, b'{"run_id": '
        if route == "submit" and method == "POST" and len(parts) == 4:
            hook = (parse_qs(url.query).get("webhookEndpoint") or [None])[0]
            if parse_qs(url.query).get("async") != ["true"] or not hook:
                return 400, {"message": "async=true and webhookEndpoint are required"}
            try:
                request = json.loads(body or b"{}")
            except ValueError:
                return 400, {"message": "body is not JSON"}
            forced = (request.get("cerebrium_fake") or {}) if isinstance(request, dict) else {}
            c = self.config
            run = Run()
            run.id = str(uuid.uuid4())
            run.submitted, run.cancel_refusals = now, 0
            run.start = now + (float(forced["queue_s"]) if "queue_s" in forced
                               else draw(c["queue_s"], self.rng))  # fmt: skip
            run.end = run.start + (float(forced["run_s"]) if "run_s" in forced
                                   else draw(c["run_s"], self.rng))  # fmt: skip
            run.outcome = forced.get("outcome", c["outcome"])
            run.output = forced.get("output", c["output"])
            run.finish_after_cancel = bool(forced.get("finish_after_cancel",
                                                      c["finish_after_cancel"]))  # fmt: skip
            run.webhook, run.cancelled_at, run.body = hook, None, None
            self.runs[run.id] = run
            self.deliverer.schedule(run.end, self._hook(run))
            return 202, {"run_id": run.id}
        if route == "app" and len(parts) == 5 and parts[1] == "projects" and parts[3] == "apps":
            status = (self.config.get("apps") or {}).get(parts[4])
            if status is None:
                return 404, {"message": "app not found"}
            return 200, {"id": parts[4], "status": status, "hardware": "AMPERE_A10"}
        if route == "cancel" and method == "DELETE" and len(parts) == 7 and parts[5] == "runs":
            run = self.runs.get(parts[6])
            if run is None:
                return 404, {"message": "run not found"}
            if run.cancelled_at is None and run.state(now) in ("QUEUED", "RUNNING"):
                run.cancelled_at = now
            return 200, {"run_id": run.id, "status": "cancelled"}
        return 404, {"message": "no such route"}

    def _refused(self, route: str, parts: list[str]) -> None:
        """Count a cancel answered with a fault or a 429 against its run (the truth's)."""
        run = self.runs.get(parts[-1]) if route == "cancel" and len(parts) == 7 else None
        if run is not None:
            run.cancel_refusals += 1

    def _hook(self, run: Run) -> Any:
        def fire() -> Any:
            with self.lock:
                if self.runs.get(run.id) is not run or run.state(time.monotonic()) == "CANCELLED":
                    return None
                fault = self.fault("webhook")
                if run.outcome == "COMPLETED":
                    run.body = {"run_id": run.id, "result": run.output}
                else:
                    run.body = {"run_id": run.id, "error": f"run {run.outcome.lower()}"}
            if fault is not None and fault[0] == "drop":
                self.deliverer.count("dropped")
                return None
            malformed = fault is not None and fault[0] == "malformed"
            data = b'{"result": ' if malformed else json.dumps(run.body).encode()
            return ("send", run.webhook, data)

        return fire

    def admin(self, method: str, parts: list[str], body: bytes) -> tuple[int, Any]:
        if parts == ["stats"]:
            return 200, {"routes": dict(self.counts), "webhooks": self.deliverer.stats(),
                         "runs": len(self.runs), "cpu_s": time.process_time()}  # fmt: skip
        if parts == ["config"] and method == "POST":
            self.configure(json.loads(body or b"{}"))
            return 200, {"ok": True}
        if parts == ["reset"] and method == "POST":
            self.reset()
            return 200, {"ok": True}
        if parts == ["truth"]:
            now = time.monotonic()
            return 200, {r.id: r.truth(now) for r in self.runs.values()}
        if len(parts) == 2 and parts[0] == "runs" and parts[1] in self.runs:
            run = self.runs[parts[1]]
            seen = {"cancelled": run.cancelled_at is not None, "webhook": run.webhook}
            return 200, {"id": run.id, "state": run.state(time.monotonic()), **seen}
        return 404, {"message": "no such admin route"}


class _Handler(JsonHandler):
    timeout_body = {"message": "gateway timeout"}
    do_GET = do_POST = do_DELETE = JsonHandler._serve

    def answer(self, body: bytes) -> tuple[int, Any, dict[str, str]]:
        code, payload = self.fake.handle(self.command, self.path, self.headers, body)
        return code, payload, {}


class FakeCerebrium(FakeProcess):
    """The fake in a child process: ``url`` (both the API and the REST root) and admin calls."""

    def __init__(self, config: dict[str, Any] | None = None, *, ready_timeout_s: float = 20.0):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        }
        super().__init__("tests.support.cerebrium_fake", "the Cerebrium fake", config,
                         ready_timeout_s=ready_timeout_s, env=env, cwd=root)  # fmt: skip

    def run(self, run_id: str) -> dict[str, Any] | None:
        found = self._admin.get(f"/admin/runs/{run_id}")
        return found.json() if found.status_code == 200 else None


def cerebrium_block(fake: FakeCerebrium, **overrides: Any) -> dict[str, Any]:
    """A ``cerebrium:`` block pointed at ``fake`` (the key from ``${CEREBRIUM_TEST_KEY}``)."""
    block = {"project_id": "p-test", "app": "tts", "function": "predict",
             "api_key": "${CEREBRIUM_TEST_KEY}", "api_url": fake.url, "rest_url": fake.url,
             "payload": "result.audio_base64",
             "timeouts": {"connect_s": 2, "read_s": 2}}  # fmt: skip
    block.update(overrides)
    return block


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--config", default="{}")
    args = parser.parse_args(argv)
    serve_fake(_Handler, Fake(json.loads(args.config)), args.port)


if __name__ == "__main__":
    main()
