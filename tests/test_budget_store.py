"""The budget ledger on a real Redis: reserve against every cap, refuse, settle once, roll over.

``RaceBudget`` is driven with attempts and race states built by the engine itself, on a clock
the test sets, so the UTC day can be moved across midnight.
"""

from __future__ import annotations

import calendar

import pytest

from gpuhedge_celery.core.attempts import Attempt, Phase
from gpuhedge_celery.core.budget import BudgetCaps, ScopeCap, to_nano, to_usd
from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.race.budget import RaceBudget
from gpuhedge_celery.store.budget import BudgetStore

pytestmark = pytest.mark.cluster

# one attempt of provider "p": cap 100 s at $0.001/s plus 20 s idle = $0.12 worst case
SPEC = {
    "caps_s": {"p": 100.0, "h": 50.0},
    "rates": {"p": {"rate_per_s": 0.001, "idle_s": 20.0}, "h": {"rate_per_s": 0.002, "idle_s": 0}},
}
P_WORST = 0.12
H_WORST = 0.1
MIDNIGHT = calendar.timegm((2031, 3, 4, 0, 0, 0))


def state(key=None, results=None):
    return {"spec": {**SPEC, "budget_key": key}, "results": results or {}}


def attempt(aid="a1", provider="p", role="primary"):
    return Attempt(id=aid, provider=provider, role=role, launched_at=0.0)


@pytest.fixture
def ledger(redis_client, prefix):
    return BudgetStore(redis_client, prefix)


def budget(ledger, caps, at=MIDNIGHT + 3600):
    return RaceBudget(ledger, caps, VirtualClock(at))


def reserve(rb, race_id, a, st):
    pending = rb.reservation(race_id, a, st)
    return rb.store.reserve(pending)


def test_reservation_charges_every_scope_and_a_repeat_changes_nothing(ledger):
    rb = budget(ledger, BudgetCaps(ceiling_usd=10))
    first = reserve(rb, "r1", attempt(), state("tenant-a"))
    again = reserve(rb, "r1", attempt(), state("tenant-a"))
    assert first.granted and not first.repeat and first.amount_nano == to_nano(P_WORST)
    assert again.granted and again.repeat
    day = "2031-03-04"
    counters = ledger.counters(
        ["all", f"d:{day}", "p:p", f"d:{day}:p:p", "k:tenant-a", f"d:{day}:k:tenant-a"]
    )
    assert set(counters.values()) == {(to_nano(P_WORST), 0)}
    entries = [e for _, e in ledger.entries()]
    assert [e["type"] for e in entries] == ["reserve"]
    assert entries[0]["provider"] == "p" and entries[0]["key"] == "tenant-a"


@pytest.mark.parametrize(
    "caps, cap_name",
    [
        (BudgetCaps(max_usd_per_request=0.2), "max_usd_per_request"),
        (BudgetCaps(max_usd_per_day=0.2), "max_usd_per_day"),
        (BudgetCaps(ceiling_usd=0.2), "ceiling_usd"),
        (BudgetCaps(providers={"p": ScopeCap(max_usd_per_day=0.2)}), "providers.p.max_usd_per_day"),
        (BudgetCaps(providers={"p": ScopeCap(max_usd_total=0.2)}), "providers.p.max_usd_total"),
    ],
)
def test_each_cap_refuses_the_attempt_that_would_pass_it(ledger, caps, cap_name):
    rb = budget(ledger, caps)
    assert reserve(rb, "r1", attempt("a1"), state()).granted  # 0.12
    refused = reserve(rb, "r1", attempt("a2"), state())  # 0.24 > 0.2
    assert not refused.granted and refused.cap == cap_name
    assert refused.reason.startswith("budget: refused by " + cap_name)
    assert ledger.counters(["all"])["all"] == (to_nano(P_WORST), 0)  # the refusal charged nothing
    types = [e["type"] for _, e in ledger.entries()]
    assert types == ["reserve", "refuse"]


def test_per_request_counts_one_race_only(ledger):
    rb = budget(ledger, BudgetCaps(max_usd_per_request=0.2))
    assert reserve(rb, "r1", attempt("a1"), state()).granted
    assert not reserve(rb, "r1", attempt("a2"), state()).granted
    assert reserve(rb, "r2", attempt("a1"), state()).granted  # another request: its own cap


def test_per_key_caps(ledger):
    caps = BudgetCaps(
        keys={"tenant-a": ScopeCap(max_usd_total=0.13), "shared": ScopeCap(0.2)},
        default_key="shared",
    )
    rb = budget(ledger, caps)
    assert reserve(rb, "r1", attempt(), state("tenant-a")).granted
    refused = reserve(rb, "r2", attempt(), state("tenant-a"))
    assert refused.cap == "keys.tenant-a.max_usd_total"
    assert reserve(rb, "r3", attempt(), state("shared")).granted
    assert reserve(rb, "r4", attempt(), state("shared")).cap == "keys.shared.max_usd_per_day"
    assert "no budget for key 'b'" in BudgetCaps(keys={"a": ScopeCap(1)}).key_problem("b")


KEYED = """providers:
  p: {adapter: sim}
  h: {adapter: sim, role: hedge}
budget:
  keys: {tenant-a: {max_usd_total: 5}, shared: {max_usd_per_day: 0.2}}
  default_key: shared
"""


def charged_state(cfg, key):
    """A race's stored state as ``hedged_infer(..., budget_key=key)`` would build it."""
    from gpuhedge_celery.race.spec import build_spec

    spec = build_spec(cfg, "single", ["p"], budget_key=key).to_dict()
    return {"spec": {**spec, **SPEC}, "results": {}}


def test_a_race_naming_no_key_is_charged_to_the_default_key(ledger):
    from gpuhedge_celery.config import parse_config_text

    cfg = parse_config_text(KEYED)
    rb = budget(ledger, cfg.budget)
    assert reserve(rb, "r1", attempt(), charged_state(cfg, None)).granted
    # the default key's $0.2 a day applies to keyless races: the second one does not fit
    refused = reserve(rb, "r2", attempt(), charged_state(cfg, None))
    assert refused.cap == "keys.shared.max_usd_per_day"
    day = "2031-03-04"
    assert ledger.totals()[f"r|d:{day}:k:shared"] == to_nano(P_WORST, round_up=True)
    assert [e["key"] for _, e in ledger.entries()] == ["shared", "shared"]


def test_an_unlisted_key_is_refused_or_shares_the_default_keys_caps(ledger):
    from gpuhedge_celery.config import parse_config_text
    from gpuhedge_celery.errors import ConfigError

    cfg = parse_config_text(KEYED)
    with pytest.raises(ConfigError) as caught:
        charged_state(cfg, "tenant-new")
    assert str(caught.value).startswith("budget_key: no budget for key 'tenant-new'")
    assert "\n" not in str(caught.value)
    # unknown_keys: default: every unlisted key is charged to the default key, sharing its cap
    shared = parse_config_text(KEYED + "  unknown_keys: default\n")
    rb = budget(ledger, shared.budget)
    assert reserve(rb, "r1", attempt(), charged_state(shared, "tenant-x")).granted
    refused = reserve(rb, "r2", attempt(), charged_state(shared, "tenant-y"))
    assert refused.cap == "keys.shared.max_usd_per_day"  # no fresh cap for a new name
    assert reserve(rb, "r3", attempt(), charged_state(shared, "tenant-a")).granted


def test_the_day_rolls_over_at_utc_midnight_and_a_settlement_goes_to_its_day(ledger):
    caps = BudgetCaps(max_usd_per_day=0.2, ceiling_usd=10)
    late = budget(ledger, caps, at=MIDNIGHT - 1)  # 23:59:59 on the 3rd
    assert reserve(late, "r1", attempt(), state()).granted
    assert not reserve(late, "r2", attempt(), state()).granted  # the 3rd is full
    early = budget(ledger, caps, at=MIDNIGHT + 1)  # 00:00:01 on the 4th: a fresh day
    assert reserve(early, "r3", attempt(), state()).granted
    # r1 settles on the 4th: it still counts on the 3rd (its day), not against the 4th
    ledger.settle("r1", [("a1", to_nano(0.05), "estimated")], (MIDNIGHT + 2) * 1000)
    c = ledger.counters(["d:2031-03-03", "d:2031-03-04", "all"])
    assert c["d:2031-03-03"] == (0, to_nano(0.05))
    assert c["d:2031-03-04"] == (to_nano(P_WORST), 0)
    assert c["all"] == (to_nano(P_WORST), to_nano(0.05))


def test_settling_frees_headroom_once_and_sums_to_the_ledger(ledger):
    rb = budget(ledger, BudgetCaps(ceiling_usd=0.2))
    assert reserve(rb, "r1", attempt(), state()).granted
    assert not reserve(rb, "r2", attempt(), state()).granted
    assert ledger.settle("r1", [("a1", to_nano(0.03), "reconciled")], 1) == (1, to_nano(0.03))
    assert ledger.settle("r1", [("a1", to_nano(0.09), "estimated")], 2) == (0, 0)
    assert reserve(rb, "r2", attempt(), state()).granted  # 0.03 + 0.12 <= 0.2 now
    # a settled attempt is never reserved (nor submitted) again
    again = reserve(rb, "r1", attempt(), state())
    assert not again.granted and again.cap == "settled"
    entries = [e for _, e in ledger.entries()]
    spent = sum(int(e["nano"]) for e in entries if e["type"] == "settle")
    assert ledger.counters(["all"])["all"] == (to_nano(P_WORST), spent)
    assert to_usd(spent) == 0.03 and ledger.open_count() == 1


def test_settlement_sources_from_the_attempts_state(ledger):
    rb = budget(ledger, BudgetCaps(ceiling_usd=10))
    a = attempt()
    reserve(rb, "r1", a, state())
    a.submitted_at, a.result_at, a.phase, a.result_state = 1.0, 11.0, Phase.ENDED, "COMPLETED"
    a.handle = {"job_id": "j"}
    # the provider reported its execution: reconciled, plus the idle window of its worker
    reported = state(results={"a1": {"metrics": {"cost_usd": 0.004}}})
    (item,) = rb.settlements(None, reported, [a])
    assert item[2] == "reconciled" and item[1] == to_nano(0.004 + 20 * 0.001)
    # nothing reported: our clock, 10 s at $0.001 plus idle
    (item,) = rb.settlements(None, state(), [a])
    assert item[2] == "estimated" and item[1] == to_nano(0.01 + 0.02)
    a.phase = Phase.LEAKED  # live: not settled, unless forced (the sweep): all of it, unproven
    assert rb.settlements(None, state(), [a]) == []
    (item,) = rb.settlements(None, state(), [a], force=True)
    assert item[2] == "unproven" and item[1] == to_nano(P_WORST)


def test_a_submit_claim_with_its_reservation_on_a_server_without_the_scripts(private_redis):
    """The first claim after a Redis restart: the pipeline is run again once the reserve script
    is loaded, and the claim it made the first time is still recognised as ours."""
    import redis

    from gpuhedge_celery.store.races import RaceStore
    from gpuhedge_celery.store.round_trip import RoundTrip

    client = redis.Redis.from_url(private_redis.url, decode_responses=True)
    races, ledger = RaceStore(client, "t"), BudgetStore(client, "t")
    rb = budget(ledger, BudgetCaps(ceiling_usd=10))
    client.script_flush()  # this test's own server: no script is loaded
    pending = rb.reservation("r1", attempt(), state())
    intent = {"submitting": True, "at": 1.0, "until": 2.0}
    trip = RoundTrip()
    pending.ride(trip)
    assert races.claim_submit("r1", "a1", intent, trip) is None  # ours: submit
    assert pending.result.granted and not pending.result.repeat
    # another process's claim of the same attempt sees the intent, and the same reservation
    again = rb.reservation("r1", attempt(), state())
    trip = RoundTrip()
    again.ride(trip)
    assert races.claim_submit("r1", "a1", {**intent, "at": 1.5}, trip) == intent
    assert again.result.granted and again.result.repeat


def test_a_reservation_never_answered_is_not_held_and_is_sent_before_any_spend(ledger):
    """On a cluster a reservation riding on a race save goes in a round trip of its own after
    the save won; when that one is lost, nothing may be spent until it is sent and answered."""
    rb = budget(ledger, BudgetCaps(ceiling_usd=10))
    pending = rb.reservation("r1", attempt(), state())
    assert pending.result is None and not pending.held
    assert ledger.open_count() == 0
    found = ledger.acknowledged(pending)
    assert found.granted and pending.held and ledger.open_count() == 1
