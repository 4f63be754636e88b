"""The RunPod side of ``gpuhedge-celery bench races --provider runpod-fake``.

The RunPod fake (``benchmarks/fakes/runpod_fake.py``: a source checkout's, see :mod:`._checkout`)
runs in its own process beside the workers, with RunPod's documented limits per endpoint (``/run``
1,000, ``/status`` 2,000, ``/cancel`` 100 per 10 s, answered with 429 past them). The bench config
gains two ``runpod`` providers on it, ``rp`` (endpoint ``bench-p``) and ``rh`` (``bench-h``), with
the adapter's default pacing and the fleet's shared budget in Redis; the capacity row is then run
twice in the same run and on the same workers: sim providers (``p`` -> ``h``) and RunPod (``rp`` ->
``rh``), with the same job times. With ``--webhooks off`` every job is polled; with ``--webhooks
on`` the webhook receiver (``gpuhedge-celery webhooks --workers N``, N from ``--receiver-workers``)
runs beside them (its CPU summed over its processes), each ``/run`` carries the attempt's webhook
URL, the fake POSTs each job's end there, and jobs are polled only before the hedge decision and as
a safety net (``GPUHEDGE_WEBHOOK_FALLBACK_S``, 30 s).

What the RunPod row adds: the fake's own counts per route (requests, the most in any 10 s
window, 429s), provider HTTP requests per job, and the fake's CPU (it shares the two cores).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import _checkout
from ._procs import tree_cpu_s

ENDPOINTS = {"rp": "bench-p", "rh": "bench-h"}
KEY = "bench-runpod-key"
LIMITS = {"run": 1000, "status": 2000, "cancel": 100}  # RunPod's, per endpoint per 10 s

PROVIDERS = """
  rp:
    role: primary
    adapter: runpod
    billed_rate_per_s: 0.0003
    idle_billed_seconds: 5
    runpod: &rp
      endpoint_id: bench-p
      api_key: "${{GPUHEDGE_BENCH_RUNPOD_KEY}}"
      base_url: "{base}"
      payload: output.audio_base64
  rh:
    role: hedge
    adapter: runpod
    billed_rate_per_s: 0.0007
    runpod:
      <<: *rp
      endpoint_id: bench-h
"""


def start_fake(webhook_senders: int = 8) -> Any:
    """The fake (a ``FakeRunpod``); ``webhook_senders``: its delivery threads, each waiting for
    the receiver's answer (RunPod's own senders are not one process's few threads)."""
    config = {"api_key": KEY, "limits": LIMITS, "window_s": 10.0}
    return _checkout.runpod_fake().FakeRunpod({**config, "webhook_senders": webhook_senders})


def providers_yaml(fake: Any) -> str:
    return PROVIDERS.format(base=fake.base_url)


def request(p_queue: float, p_run: float, h_queue: float, h_run: float) -> dict[str, Any]:
    """A capacity-row request forcing both RunPod jobs' times (real seconds)."""
    return {
        "runpod_fake": {
            ENDPOINTS["rp"]: {"queue_s": p_queue, "run_s": p_run},
            ENDPOINTS["rh"]: {"queue_s": h_queue, "run_s": h_run},
        }
    }


def start_receiver(env: dict[str, str], tmp: Path, workers: int = 1) -> subprocess.Popen:
    """The webhook receiver (``--workers`` processes) in a session of its own; sets the webhook
    variables in ``env`` (the workers' environment) first. Returns once each process answered."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env["GPUHEDGE_WEBHOOK_URL"] = f"http://127.0.0.1:{port}/hooks"
    env["GPUHEDGE_WEBHOOK_SECRET"] = secrets.token_hex(16)
    argv = [
        sys.executable,
        "-m",
        "gpuhedge_celery",
        "webhooks",
        "--port",
        str(port),
        "--workers",
        str(workers),
    ]
    with open(tmp / "receiver.log", "wb") as out:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=str(tmp),
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    seen: set[str] = set()  # the pids that answered (each check a new connection)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((tmp / "receiver.log").read_text()[-2000:])
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/healthz")
            seen.add(r.headers.get("x-gpuhedge-receiver", ""))
            if r.status_code == 200 and len(seen) >= workers:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    stop_receiver(proc)
    raise RuntimeError(f"the webhook receiver ({workers} processes) did not start in 60 s")


def stop_receiver(proc: subprocess.Popen) -> None:
    """Kill the receiver and its processes (its session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def receiver_cpu_s(proc: subprocess.Popen) -> float:
    """CPU seconds the receiver's processes have used (the command's and its children's)."""
    return tree_cpu_s(proc.pid)


def report(
    fake: Any,
    cpu0: float,
    receipts: list[dict[str, Any]],
    webhooks: bool = False,
    receivers: int = 0,
) -> dict[str, Any]:
    """The fake's view of one row: per route, per job, against RunPod's limits."""
    stats = fake.stats()
    routes = stats["routes"]
    jobs = sum(routes.get(f"{ep} run", {}).get("requests", 0) for ep in ENDPOINTS.values())
    per_route: dict[str, Any] = {}
    total = 0
    for name, counts in routes.items():
        ep, route = name.split(" ", 1)
        total += counts["requests"]
        limit = LIMITS.get(route)
        within = limit is None or counts["max_in_window"] <= limit
        per_route[name] = {**counts, "limit_per_10s": limit, "within_limit": within}
    by_route: dict[str, int] = {}
    for name, counts in routes.items():
        route = name.split(" ", 1)[1]
        by_route[route] = by_route.get(route, 0) + counts["requests"]
    leaks = sum(len(r.get("leaks") or []) for r in receipts)
    cancels = [a.get("cancel_receipt") or {} for r in receipts for a in r["attempts"]]
    sent = [c for c in cancels if c.get("cancel_ack_ms") is not None]
    return {
        "provider_jobs": jobs,
        "provider_requests": total,
        "requests_per_job": round(total / jobs, 2) if jobs else None,
        "requests_per_job_by_route": {k: round(v / jobs, 2) for k, v in by_route.items()}
        if jobs
        else {},
        "routes": per_route,
        "never_over_limit": all(r["within_limit"] for r in per_route.values()),
        "fake_cpu_s": round(stats["cpu_s"] - cpu0, 2),
        "cancels_acknowledged": len(sent),
        "leaks": leaks,
        "webhooks": "on" if webhooks else "off",
        "receiver_processes": receivers if webhooks else 0,
        "webhook_deliveries": stats.get("webhooks"),
    }
