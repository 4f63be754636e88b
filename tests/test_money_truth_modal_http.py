"""What the product says about money on Modal and the generic HTTP job API, against what those
providers billed.

Two real coordination workers race ``h`` (adapter ``http``, on the loopback HTTP job API server,
which reports queue state and ``executionTime``) and ``m`` (adapter ``modal``, on the Modal
stand-in in its own process, which reports neither) both ways round: a cutover from ``h`` to
``m`` (``h`` still queued at 0.5 s is cancelled for ``m``; one still running at 1.5 s is hedged)
and a hedge from ``m`` to ``h``. A budget reserves every attempt. Each race forces its jobs'
fates: a primary winning alone, one stuck in its queue, a slow one cancelled while running, a
hedge cancelled while running or while still queued; a third of the way in both fakes refuse
two cancels. Once every job has ended at the fakes, every receipt is written and the
reservations are settled, the fakes' truth (when each job started and stopped, what it billed)
is compared with every receipt, race record and ledger settlement (``tests/support/truth.py``),
and the comparison is printed as JSON.

The http adapter prices each job from its reported ``executionTime``: every attempt must match
the truth. Modal shows no queue and no execution time, so the product prices a call on its
clock, from the submit to the observed end (docs/providers.md, *Billing evidence*): an upper
bound of the running seconds Modal bills, above them by the call's queue (a call cancelled
while still queued included) and by up to one watch poll, never below them (a cancelled call
is priced to its end as a poll saw it, not to the cancel's acknowledgement, which comes a
moment before the call stops). Each Modal attempt must lie within those bounds, and the wasted
dollars within 5 % of the truth plus the Modal queue seconds the product cannot see.
"""

from __future__ import annotations

import json
import time

import pytest

from gpuhedge_celery.bench._truth_row import submit_spread, wait_settled
from tests.support.fleet import fleet_cluster
from tests.support.http_provider_server import HttpProviderServer
from tests.support.modal_fake import FakeModalProcess
from tests.support.race_configs import modal_provider, race_config
from tests.support.truth import (
    agree,
    compare,
    gather,
    merge_truth,
    product_failures,
    rates_from_config,
    receipt_attempt_cost,
)

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.slow, pytest.mark.timeout(120)]

KEY = "http-test-key-0123456789-very-secret"
CUTOVER = "cutover:h->m@q0.5s+s1.5s"
HEDGE = "hedge:m->h@0.5s"
LATE_HEDGE = "hedge:m->h@1.5s"
RACES = 36
SUBMIT_WINDOW_S = 6.0
SETTLE_LIMIT_S = 30.0  # from the last submit to every job ended and every receipt written
TOTAL_LIMIT_S = 45.0
TOLERANCE = 0.05
WATCH_S = 1.0  # the workers' GPUHEDGE_WATCH_INTERVAL_S: a Modal end is seen up to this late
CANCEL_EFFECT_S = 0.05  # the Modal fake's cancel_effect_s: a call stops this long after it
SLACK_S = 0.25  # a spawn's and a cancel's round trips, and scheduling on a busy machine
CLOCKS_S = 0.01  # the fake's and the workers' readings of the same wall clock


def http_provider(role: str, rate: float, url: str, **extra: object) -> dict:
    """An ``http`` provider on the loopback job API at ``url`` (RunPod-shaped, as
    config/http-example.yaml), its key from ``${HTTP_TEST_KEY}``."""
    http = {
        "base_url": f"{url}/v2/ep1",
        "headers": {"authorization": "${HTTP_TEST_KEY}"},
        "timeouts": {"connect_s": 2, "read_s": 5},
        "poll_interval_s": 0.05,
        "cancel_confirm_s": 5,
        "submit": {"url": "/run", "body": {"input": "{request}"}, "job_id": "id"},
        "status": {
            "url": "/status/{job_id}",
            "state": "status",
            "payload": "output.audio_base64",
            "error": "error",
            "metrics": {"delay_ms": "delayTime", "execution_ms": "executionTime"},
        },
        "cancel": {"url": "/cancel/{job_id}"},
        "terminal_stops_billing": True,
    }
    return {"role": role, "adapter": "http", "billed_rate_per_s": rate, **extra, "http": http}


def config_text(http_url: str, modal_url: str) -> str:
    caps = {"max_usd_per_day": 20}
    return race_config(
        {
            "h": http_provider("primary", 0.0003, http_url, idle_billed_seconds=5),
            "m": modal_provider("hedge", 0.0007, url=modal_url, idle_billed_seconds=2),
        },
        "cutover",
        {"queue_cutover_ms": 500, "safety_hedge_ms": 1500},
        timeouts={"attempt_cap_s": 30},
        budget={
            "max_usd_per_request": 0.1,
            "max_usd_per_day": 50,
            "ceiling_usd": 1000,
            "providers": {"h": caps, "m": caps},
        },
    )


# Each race's policy and fates, by its index: (policy, http job, Modal call), real seconds.
FATES = [
    (CUTOVER, {"queue_s": 0.1, "run_s": 0.3}, {"start_s": 0.05, "run_s": 0.4}),  # h alone
    (CUTOVER, {"queue_s": 6.0, "run_s": 0.5}, {"start_s": 0.05, "run_s": 0.4}),  # h queued: cut
    (CUTOVER, {"queue_s": 0.1, "run_s": 5.0}, {"start_s": 0.05, "run_s": 0.4}),  # h slow: m wins
    (CUTOVER, {"queue_s": 0.1, "run_s": 1.9}, {"start_s": 0.05, "run_s": 1.5}),  # m stopped
    (CUTOVER, {"queue_s": 0.1, "run_s": 1.9}, {"start_s": 3.0, "run_s": 1.0}),  # m still queued
    (LATE_HEDGE, {"queue_s": 0.1, "run_s": 0.4}, {"start_s": 0.05, "run_s": 0.3}),  # m alone
    (HEDGE, {"queue_s": 0.1, "run_s": 0.4}, {"start_s": 0.05, "run_s": 5.0}),  # m slow: h wins
    (HEDGE, {"queue_s": 0.1, "run_s": 3.0}, {"start_s": 0.05, "run_s": 1.2}),  # h stopped
    (HEDGE, {"queue_s": 3.0, "run_s": 1.0}, {"start_s": 0.05, "run_s": 1.2}),  # h still queued
]


def request_for(i: int) -> tuple[dict, str]:
    policy, http, modal = FATES[i % len(FATES)]
    return {"text": f"race {i}", "http_fake": http, "modal_fake": modal}, policy


@pytest.fixture
def cluster(redis_url, tmp_path, broker, request):
    from tests.support.fixtures_celery import broker_url_for

    modal = FakeModalProcess()
    try:
        with (
            HttpProviderServer() as http,
            fleet_cluster(
                redis_url,
                tmp_path,
                config_text(http.url, modal.url),
                broker_url=broker_url_for(broker, request),
                env={"HTTP_TEST_KEY": KEY, "GPUHEDGE_WATCH_INTERVAL_S": f"{WATCH_S:g}"},
            ) as rc,
        ):
            http.knobs.api_key = KEY
            http.knobs.cancel_terminal_after_s = 0.05
            modal.set_knobs(cancel_effect_s=CANCEL_EFFECT_S)
            rc.fakes = {"h": http, "m": modal}
            yield rc
    finally:
        modal.stop()


def run_load(rc, n: int) -> tuple[list[str], dict]:
    """Start ``n`` races within :data:`SUBMIT_WINDOW_S`, refuse two cancels on each fake a third
    of the way in, then wait for every job to end, every receipt and no reservation open."""
    http, modal = rc.fakes["h"], rc.fakes["m"]

    def refuse_cancels():
        http.knobs.cancel_errors = 2
        modal.set_knobs(cancel_errors=2)

    def send(i):
        req, policy = request_for(i)
        return rc.send(req, policy=policy).id

    ids, submit_s = submit_spread(send, n, SUBMIT_WINDOW_S, refuse_cancels)
    waited = wait_settled(rc.client, rc.prefix, ids, [http, modal], SETTLE_LIMIT_S)
    return ids, {"races": n, "submit_s": round(submit_s, 2), **waited}


def per_attempt(receipts, truth, rates) -> tuple[list[str], dict]:
    """Each attempt's receipt against its job's truth: the http adapter's must agree, Modal's
    must lie within its clock's bounds (see the module docstring). Returns the attempts out of
    bounds, and per provider the wasted $ (truth, receipts, and truth plus the queue seconds a
    provider that shows no queue is priced for)."""
    wrong: list[str] = []
    wasted = {p: {"truth": 0.0, "receipts": 0.0, "truth_plus_unseen_queue": 0.0} for p in rates}
    for receipt in receipts:
        for a in receipt["attempts"]:
            t = truth.get(a.get("job_id") or "")
            if t is None:
                continue
            rate = rates[a["provider"]].rate_per_s
            found = receipt_attempt_cost(a, rates[a["provider"]])[0]
            true = float(t["billed_s"]) * rate
            unseen = float(t["queued_s"]) * rate if a["provider"] == "m" else 0.0
            if a["id"] != receipt["winner"]:
                w = wasted[a["provider"]]
                w["truth"] += true
                w["receipts"] += found
                w["truth_plus_unseen_queue"] += true + unseen
            where = f"{a['provider']} {receipt['race_id']} {a['id']} {a.get('timeline')}"
            if a["provider"] == "h" and not agree(found, true):
                wrong.append(f"{where}: receipt {found:.7f} != truth {true:.7f}")
            if a["provider"] == "m":
                low = true - CLOCKS_S * rate
                high = true + unseen + (WATCH_S + SLACK_S) * rate
                if not low <= found <= high:
                    wrong.append(f"{where}: receipt {found:.7f} outside [{low:.7f}, {high:.7f}]")
    return wrong, {p: {k: round(v, 7) for k, v in w.items()} for p, w in wasted.items()}


def test_money_on_modal_and_http_matches_what_they_billed(cluster):
    t0 = time.monotonic()
    ids, timing = run_load(cluster, RACES)
    truth = merge_truth(**{name: fake.truth() for name, fake in cluster.fakes.items()})
    found = gather(cluster.client, cluster.prefix, ids)
    rates = rates_from_config(cluster.config)
    report = compare(
        truth,
        rates,
        found["receipts"],
        found["records"],
        found["ledger"],
        found["open_reservations"],
    )
    out_of_bounds, wasted_by_provider = per_attempt(found["receipts"], truth, rates)
    report["wasted_usd_by_provider"] = wasted_by_provider
    report["timing"] = {**timing, "total_s": round(time.monotonic() - t0, 2)}
    print("MONEY-TRUTH-MODAL-HTTP " + json.dumps(report, sort_keys=True))
    if timing["races_without_receipt"]:
        print(cluster.logs())
    failures = []
    if report["timing"]["total_s"] > TOTAL_LIMIT_S:
        failures.append(f"took {report['timing']['total_s']} s (limit {TOTAL_LIMIT_S} s)")
    if timing["races_without_receipt"]:
        failures.append(f"{timing['races_without_receipt']} races wrote no receipt")
    if report["jobs_not_ended"]:
        failures.append(f"{len(report['jobs_not_ended'])} jobs still running at the fakes")
    if report["open_reservations"]:
        failures.append(f"{report['open_reservations']} reservations open after every job ended")
    kinds = set(report["by_kind"])
    for kind in ("lost cancelled_queued", "lost stopped_running", "lost refused_cancel_ran_on"):
        missing = [p for p in ("h", "m") if f"{p} {kind}" not in kinds]
        if missing:  # the fates and the injected refusals make every one of these
            failures.append(f"no {kind} attempt on {missing}: {sorted(kinds)}")
    if out_of_bounds:
        failures.append(f"{len(out_of_bounds)} attempts off their truth: {out_of_bounds[:10]}")
    expected = sum(w["truth_plus_unseen_queue"] for w in wasted_by_provider.values())
    got = report["wasted_usd"]["receipts"]
    if abs(got - expected) > TOLERANCE * expected:
        failures.append(f"wasted $: receipts {got} vs truth with Modal's queue {expected}")
    failures += product_failures(report)
    assert not failures, failures
