"""Eight worker processes race near the caps: no cap is ever passed, and the ledger adds up.

Eight real coordination workers (threads pool, 8 threads each) run 36 hedged races started at
once, each reserving up to $0.118 of worst cases against a per-day cap, a lifetime ceiling, a
per-provider cap and per-key caps that cannot hold them all: many attempts are refused. The
ledger stream is appended in the same script as every counter change, so replaying it in
order rebuilds each counter's whole history: at no point did any capped counter pass its cap.
Once every race is over, nothing is reserved and the settled costs sum to the spent counter.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from gpuhedge_celery.core.budget import BudgetCaps, limits, scopes
from gpuhedge_celery.errors import BudgetExceeded, RaceFailed
from gpuhedge_celery.store.budget import BudgetStore
from tests.support.budget_config import HEDGED_SIM_CONFIG
from tests.support.fixtures_races import start_race_cluster, stop_race_cluster

pytestmark = pytest.mark.timeout(300)

CONFIG = (
    HEDGED_SIM_CONFIG
    + """budget:
  max_usd_per_request: 0.2
  max_usd_per_day: 0.9
  ceiling_usd: 1.2
  providers:
    h: {max_usd_per_day: 0.25}
  keys:
    k0: {max_usd_total: 0.1}     # its first race cannot afford its hedge
    k1: {max_usd_per_day: 0.6}
    k2: {max_usd_per_day: 0.6}
  default_key: k1
validator: wav
"""
)
RACES = 36
WORKERS = 8
# the primary runs 40 provider s; the hedge is launched at 5 s and runs 20 s: it usually wins
REQUEST = {"sim": {"p": {"queue_s": 1, "run_s": 40}, "h": {"queue_s": 0.5, "run_s": 20}}}


def replay(entries, caps: BudgetCaps):
    """Rebuild every counter from the ledger in order: every excess over a cap, the counters,
    the reservations left open and the caps that refused something."""
    reserved, spent, request = defaultdict(int), defaultdict(int), defaultdict(int)
    excess = []
    reservations = {}
    refusals: set[str] = set()
    for _, e in entries:
        kind = e["type"]
        if kind == "reserve":
            key = e["key"] or None
            touched = scopes(e["day"], e["provider"], key)
            nano = int(e["nano"])
            reservations[e["id"]] = (touched, nano)
            for s in touched:
                reserved[s] += nano
            request[e["race"]] += nano
            for lim in limits(caps, e["day"], e["provider"], key):
                used = (
                    request[e["race"]]
                    if lim.scope == "request"
                    else reserved[lim.scope] + spent[lim.scope]
                )
                if used > lim.limit_nano:
                    excess.append((lim.name, used, lim.limit_nano, e["id"]))
        elif kind == "refuse":
            key = e["key"] or None
            index = int(e["cap_index"])
            scope = "request" if index == 0 else scopes(e["day"], e["provider"], key)[index - 1]
            by = next(
                lim for lim in limits(caps, e["day"], e["provider"], key) if lim.scope == scope
            )
            refusals.add(by.name)
            used = request[e["race"]] if scope == "request" else reserved[scope] + spent[scope]
            assert used == int(e["used_nano"])  # it saw exactly the counter we rebuilt
            assert used + int(e["nano"]) > by.limit_nano
        elif kind == "settle":
            touched, nano = reservations.pop(e["id"])
            assert int(e["reserved_nano"]) == nano
            for s in touched:
                reserved[s] -= nano
                spent[s] += int(e["nano"])
            request[e["race"]] += int(e["nano"]) - nano
    return excess, reserved, spent, reservations, refusals


def test_eight_workers_racing_near_the_caps_never_pass_one(redis_url, tmp_path):
    rc = start_race_cluster(redis_url, tmp_path, workers=WORKERS, config=CONFIG)
    try:
        ledger = BudgetStore(rc.client, rc.prefix)
        sent = [
            rc.send(REQUEST, policy="hedge:p->h@0.05s", budget_key=f"k{i % 3}")
            for i in range(RACES)
        ]
        won = refused = failed = 0
        for res in sent:
            try:
                res.get(timeout=60)
                won += 1
            except BudgetExceeded:
                refused += 1
            except RaceFailed:
                failed += 1
        for res in sent:
            rc.receipt(res.id, timeout=30)
        entries = list(ledger.entries())
        kinds = [e["type"] for _, e in entries]
        # near the caps: both outcomes happened, and hedges were refused as well as primaries
        assert won > 0 and refused > 0 and kinds.count("refuse") > refused, (won, refused, kinds)
        caps = rc.config.budget
        excess, reserved, spent, still_open, refused_by = replay(entries, caps)
        assert excess == [], excess[:5]
        assert len(refused_by) >= 2, refused_by  # several caps bit, not just one
        # every reservation settled; nothing stays reserved; the counters are the ledger's
        assert still_open == {} and ledger.open_count() == 0
        totals = ledger.totals()
        assert all(v == 0 for k, v in totals.items() if k.startswith("r|"))
        assert {k[2:]: v for k, v in totals.items() if k.startswith("s|")} == {
            k: v for k, v in spent.items() if v or f"s|{k}" in totals
        }
        settles = [e for _, e in entries if e["type"] == "settle"]
        assert totals["s|all"] == sum(int(e["nano"]) for e in settles)
        assert all(int(e["nano"]) <= int(e["reserved_nano"]) for e in settles)
        assert {e["source"] for e in settles} <= {"reconciled", "not_submitted"}
        # no cap ended up passed either
        day = entries[-1][1].get("day") or next(e["day"] for _, e in entries if "day" in e)
        assert totals["s|all"] <= caps.ceiling_usd * 1e9
        assert totals.get(f"s|d:{day}", 0) <= caps.max_usd_per_day * 1e9
        assert totals.get(f"s|d:{day}:p:h", 0) <= 0.25 * 1e9
        assert failed == 0, rc.logs()
    finally:
        stop_race_cluster(rc)
