"""The RunPod fake's account API: ``POST /graphql`` (``query { myself { ... } }``).

Authenticated by ``Authorization: Bearer <api_key>`` (401 otherwise). ``myself`` answers
``id`` (``account_id``), ``clientBalance`` and ``currentSpendPerHr``: the balance starts at
``balance_usd`` and falls as the fake's jobs run, by their execution seconds so far ×
``balance_usd_per_s``, plus ``balance_idle_s`` of idle billing after each job that ran
(capped by the time since it ended). Jobs forgotten by ``/admin/reset`` are forgotten here too.

``faults.graphql``: ``errors_next`` (HTTP 200 with ``{"errors": [{"message":
error_message}]}``, as RunPod often answers), ``unauthorized_next`` (401).
"""

from __future__ import annotations

import json
from typing import Any

DEFAULTS = {
    "account_id": "fake-account-1",
    "balance_usd": 100.0,
    "balance_usd_per_s": 0.001,
    "balance_idle_s": 0.0,
}


def billed_s(job: Any, now: float, idle_s: float) -> tuple[float, bool]:
    """(seconds ``job`` has billed by ``now``, whether it is running)."""
    start = job.submitted + job.queue_s
    end = start + job.run_s
    if job.cancelled_at is not None and job.cancelled_at < start:
        return 0.0, False
    if job.stop_at is not None and job.stop_at < end:
        end = job.stop_at
    if now <= start:
        return 0.0, False
    ran = min(now, end) - start
    idle = min(idle_s, max(0.0, now - end)) if ran > 0 else 0.0
    return ran + idle, now < end


def graphql(fake: Any, method: str, headers: Any, body: bytes, now: float) -> tuple[int, Any, dict]:
    config = {**DEFAULTS, **fake.config}
    if headers.get("authorization") != f"Bearer {config['api_key']}":
        return 401, {"error": "unauthorized"}, {}
    faults = (config.get("faults") or {}).get("graphql") or {}
    if faults.get("unauthorized_next", 0) > 0:
        faults["unauthorized_next"] -= 1
        return 401, {"error": "unauthorized"}, {}
    if faults.get("errors_next", 0) > 0:
        faults["errors_next"] -= 1
        message = faults.get("error_message", "Something went wrong. Please try again later.")
        return 200, {"errors": [{"message": message}]}, {}
    if method != "POST":
        return 405, {"error": "method not allowed"}, {}
    try:
        text = json.loads(body or b"{}").get("query", "")
    except (ValueError, AttributeError):
        return 400, {"errors": [{"message": "body is not JSON"}]}, {}
    if "myself" not in str(text):
        return 200, {"errors": [{"message": "the fake answers only myself"}]}, {}
    rate, idle_s = float(config["balance_usd_per_s"]), float(config["balance_idle_s"])
    spent_s, running = 0.0, 0
    for job in fake.jobs.values():
        seconds, live = billed_s(job, now, idle_s)
        spent_s += seconds
        running += live
    myself = {
        "id": config["account_id"],
        "clientBalance": float(config["balance_usd"]) - spent_s * rate,
        "currentSpendPerHr": running * rate * 3600.0,
    }
    return 200, {"data": {"myself": myself}}, {}
