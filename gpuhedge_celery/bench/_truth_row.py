"""The ``truth`` row of ``gpuhedge-celery bench races``: money reported against money billed.

Its own workers (real time, ``time_scale`` 1), the RunPod fake with two endpoints (``rp``
primary, ``rh`` hedge), the webhook receiver, and a budget with caps. ``--truth-races`` races
start within :data:`WINDOW_S` seconds under the state-aware cutover policy, each forcing its
jobs' fates (a fast primary; one stuck in its queue, cut over; a slow one, hedged and cancelled
while running; a hedge cancelled while running); a third of the way in, the fake refuses a
run of cancels. Once every job has ended at the fake and every receipt is written (or
:data:`SETTLE_LIMIT_S` passed), the fake's truth is compared with every receipt, race record and
ledger settlement (:mod:`.money_truth`) and the comparison is the row.

The load helpers (:func:`submit_spread`, :func:`wait_settled`) are the test's too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from .money_truth import compare, gather, rates_from_config

WINDOW_S = 10.0  # every race is submitted within this many seconds
SETTLE_LIMIT_S = 90.0  # from the last submit to every job ended and every receipt written
GRACE_S = 10.0  # then this long at most for the last reservations to settle
POLICY = "cutover:rp->rh@q0.5s+s1.5s"
BUDGET = """budget:
  max_usd_per_request: 0.2
  max_usd_per_day: 50
  ceiling_usd: 1000
  providers:
    rp: {max_usd_per_day: 20}
    rh: {max_usd_per_day: 30}
"""

# Each race's fates, by its index: (primary job, hedge job), real seconds.
FATES = [
    ({"queue_s": 0.1, "run_s": 0.3}, {"queue_s": 0.1, "run_s": 0.4}),  # the primary wins alone
    ({"queue_s": 6.0, "run_s": 0.5}, {"queue_s": 0.1, "run_s": 0.4}),  # queued: cut over
    ({"queue_s": 0.1, "run_s": 5.0}, {"queue_s": 0.1, "run_s": 0.4}),  # slow: the hedge wins
    ({"queue_s": 0.1, "run_s": 1.9}, {"queue_s": 0.05, "run_s": 1.5}),  # the running hedge stops
]


def submit_spread(
    send: Callable[[int], str],
    n: int,
    window_s: float = WINDOW_S,
    midway: Callable[[], None] | None = None,
) -> tuple[list[str], float]:
    """``send(i)`` for ``i`` in ``range(n)``, evenly over 90 % of ``window_s``; ``midway`` runs
    a third of the way in. Returns the race ids and the seconds the submits took."""
    ids = []
    t0 = time.monotonic()
    gap = window_s * 0.9 / n
    for i in range(n):
        if i == n // 3 and midway is not None:
            midway()
        ids.append(send(i))
        time.sleep(max(0.0, t0 + (i + 1) * gap - time.monotonic()))
    return ids, time.monotonic() - t0


def wait_settled(
    client: Any,
    prefix: str,
    ids: Sequence[str],
    fakes: Sequence[Any],
    limit_s: float = SETTLE_LIMIT_S,
    grace_s: float = GRACE_S,
) -> dict[str, Any]:
    """Wait until every race wrote its receipt, every job ended at ``fakes`` and no
    reservation is open: at most ``limit_s``, and at most ``grace_s`` for the reservations once
    the rest is done. Says how long it took and what was left."""
    from ..store.budget import BudgetStore
    from ..store.races import RaceStore

    store, budget = RaceStore(client, prefix), BudgetStore(client, prefix)
    t0 = time.monotonic()
    deadline = t0 + limit_s
    pending, running, open_now = set(ids), [""], -1
    ended_at = None
    open_when_done = None
    while time.monotonic() < deadline:
        pending = {i for i in pending if store.receipt(i) is None}
        running = [k for f in fakes for k, t in f.truth().items() if not t["ended"]]
        open_now = budget.open_count()
        if not pending and not running:
            if ended_at is None:
                ended_at, open_when_done = time.monotonic(), open_now
            if open_now == 0:
                break
            deadline = min(deadline, ended_at + grace_s)
        time.sleep(0.5)
    return {
        "waited_s": round(time.monotonic() - t0, 2),
        "jobs_and_receipts_done_after_s": None if ended_at is None else round(ended_at - t0, 2),
        "open_reservations_when_jobs_and_receipts_done": open_when_done,
        "races_without_receipt": len(pending),
        "jobs_running": len(running),
        "open_reservations": open_now,
    }


def truth_row(
    bench_cluster: Callable[..., Any], url: str | None, workers: int, concurrency: int, races: int
) -> dict[str, Any]:
    """The row (see the module docstring)."""
    from . import _checkout
    from .races_runpod import ENDPOINTS, request

    _checkout.runpod_fake()  # no checkout's fake: say so before any process starts
    tagged = {ep: name for name, ep in ENDPOINTS.items()}
    cluster = bench_cluster(
        url, workers, concurrency, 1.0, provider="runpod-fake", webhooks=True, extra_config=BUDGET
    )
    with cluster as bench:
        fake = bench.fake
        fake.configure(webhook_gap_s=0.5)

        def send(i: int) -> str:
            (p, h) = FATES[i % len(FATES)]
            req = request(p["queue_s"], p["run_s"], h["queue_s"], h["run_s"])
            return bench.send(req, policy=POLICY).id

        def refuse_cancels() -> None:
            fake.configure(faults={"cancel": {"errors_next": max(3, races // 25)}})

        t0 = time.monotonic()
        ids, submit_s = submit_spread(send, races, midway=refuse_cancels)
        waited = wait_settled(bench.client, bench.prefix, ids, [fake])
        truth = {
            k: {**t, "provider": tagged.get(t.get("endpoint"), "")} for k, t in fake.truth().items()
        }
        found = gather(bench.client, bench.prefix, ids)
        report = compare(
            truth,
            rates_from_config(bench.config),
            found["receipts"],
            found["records"],
            found["ledger"],
            found["open_reservations"],
        )
        report["timing"] = {
            "races": races,
            "submit_s": round(submit_s, 2),
            **waited,
            "total_s": round(time.monotonic() - t0, 2),
        }
    # its own cluster: the run's --webhooks and time scale do not apply to it
    row_setup = {"webhooks": "on", "time_scale": 1.0, "budget": "capped", "fake": "runpod"}
    return {"row": "truth", "policy": POLICY, "row_setup": row_setup, **report}


__all__ = [
    "FATES",
    "POLICY",
    "SETTLE_LIMIT_S",
    "WINDOW_S",
    "submit_spread",
    "truth_row",
    "wait_settled",
]
