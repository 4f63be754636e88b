"""The metric hooks, in this process: what a race, a timer, a provider call and the janitor count.

Races run through the real driver on a real redis-server with sim providers (as in
test_races_driver.py); each test reads prometheus_client's default registry before and after
and checks the difference, so tests never depend on one another.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from gpuhedge_celery.core.budget import BudgetCaps, ScopeCap
from gpuhedge_celery.core.race_events import TimerDue
from gpuhedge_celery.errors import ProviderError, SubmitError
from gpuhedge_celery.metrics import record
from gpuhedge_celery.metrics.definitions import WORKER_METRICS
from gpuhedge_celery.race.budget import RaceBudget, attempt_worst_case_usd
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.store.budget import BudgetStore
from gpuhedge_celery.store.timer_service import TimerService
from gpuhedge_celery.store.timers import TimerStore
from tests.support.fixtures_races import RACE_CONFIG
from tests.test_flower_events import LEAKY
from tests.test_races_driver import Recorder, build_driver

pytestmark = [pytest.mark.timeout(60), pytest.mark.cluster]

FAST = {"sim": {"p": {"queue_s": 0, "run_s": 0}}}
QUEUED = {"sim": {"p": {"queue_s": 500, "run_s": 1}}}  # 5 s queued (time_scale 0.01)


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Delta:
    """Values of some samples now; ``.of(...)`` is how much one grew since."""

    def __init__(self) -> None:
        self.before = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in REGISTRY.collect()
            if family.name.startswith("gpuhedge_")
            for s in family.samples
        }

    def of(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return value(name, **labels) - self.before.get(key, 0.0)


@pytest.fixture
def setup(redis_client, prefix):
    assert record.active()  # prometheus_client is a test dependency
    return build_driver(redis_client, prefix, Recorder())


def test_a_race_won_by_its_primary(setup):
    driver, effects, cfg, _, _ = setup
    d = Delta()
    driver.create("m1", FAST, build_spec(cfg))
    driver.submit_attempt("m1", "a1")  # submits, polls: terminal, concluded inline
    assert [r["winner"] for r in effects.results] == ["p"]
    assert d.of("gpuhedge_races_started_total", policy="hedge") == 1
    assert d.of("gpuhedge_races_won_total", provider="p", role="primary") == 1
    assert d.of("gpuhedge_race_e2e_seconds_count", policy="hedge") == 1
    assert d.of("gpuhedge_race_overhead_seconds_count") == 1
    assert d.of("gpuhedge_races_hedged_total", policy="hedge") == 0
    assert d.of("gpuhedge_races_failed_total", reason="invalid_result") == 0
    assert d.of("gpuhedge_provider_requests_total", provider="p", route="submit") == 1
    assert d.of("gpuhedge_provider_requests_total", provider="p", route="status") >= 1
    receipt = driver.store.receipt("m1")
    assert d.of("gpuhedge_race_billed_usd_total") == pytest.approx(receipt["billed_usd"])
    assert d.of("gpuhedge_race_wasted_usd_total") == 0


def test_a_hedged_race_counts_the_hedge_its_winner_and_the_cancelled_loser(setup):
    driver, effects, cfg, _, _ = setup
    request = {"sim": {"p": {"queue_s": 0, "run_s": 100}, "h": {"queue_s": 0, "run_s": 0}}}
    d = Delta()
    driver.create("m2", request, build_spec(cfg, policy="hedge:p->h@0s"))
    driver.submit_attempt("m2", "a1")
    driver.submit_attempt("m2", "a2")  # the hedge answers at once and wins
    assert effects.cancelled == [("m2", "a1")]
    driver.cancel_attempt("m2", "a1")  # what the cancel thread would do: native cancel
    receipt = driver.store.receipt("m2")
    assert receipt is not None and receipt["winner"] == "a2"
    assert d.of("gpuhedge_races_hedged_total", policy="hedge") == 1
    assert d.of("gpuhedge_races_won_total", provider="h", role="hedge") == 1
    assert d.of("gpuhedge_race_losers_cancelled_total", provider="p",
                evidence="confirmed_terminal") == 1  # fmt: skip
    assert d.of("gpuhedge_race_leaks_total", provider="p") == 0
    assert d.of("gpuhedge_provider_requests_total", provider="p", route="cancel") == 1
    assert receipt["wasted_usd"] > 0
    assert d.of("gpuhedge_race_wasted_usd_total") == pytest.approx(receipt["wasted_usd"])
    assert d.of("gpuhedge_race_billed_usd_total") == pytest.approx(receipt["billed_usd"])


def test_a_cut_over_counts_once_with_its_hedge(setup):
    driver, effects, cfg, _, _ = setup
    d = Delta()
    driver.create("m7", QUEUED, build_spec(cfg, policy="cutover:p->h@q0s+s60s"))
    driver.submit_attempt("m7", "a1")
    driver.step("m7", TimerDue("cutover"))  # due now: the poll says queued, so it cuts over
    assert effects.cancelled == [("m7", "a1")] and effects.launched[1:] == [("m7", "a2")]
    driver.step("m7", TimerDue("cutover"))  # a duplicate delivery changes nothing
    assert d.of("gpuhedge_races_cut_over_total", policy="cutover") == 1
    assert d.of("gpuhedge_races_hedged_total", policy="cutover") == 0  # launched, not yet sent
    driver.submit_attempt("m7", "a2")
    assert d.of("gpuhedge_races_hedged_total", policy="cutover") == 1
    assert d.of("gpuhedge_races_escalated_total", policy="cutover") == 0


def test_a_primary_that_is_running_is_not_cut_over(setup):
    driver, effects, cfg, _, _ = setup
    d = Delta()
    running = {"sim": {"p": {"queue_s": 0, "run_s": 500}}}
    driver.create("m8", running, build_spec(cfg, policy="cutover:p->h@q0s+s60s"))
    driver.submit_attempt("m8", "a1")
    driver.step("m8", TimerDue("cutover"))
    assert effects.cancelled == []
    assert d.of("gpuhedge_races_cut_over_total", policy="cutover") == 0


def test_an_escalation_counts_once(setup):
    driver, effects, cfg, _, _ = setup
    d = Delta()
    driver.create("m9", QUEUED, build_spec(cfg, policy="cascade:p->h->f@q60s+s60s+e0s"))
    driver.submit_attempt("m9", "a1")
    driver.step("m9", TimerDue("escalate"))  # due now: the fallback is launched
    driver.step("m9", TimerDue("escalate"))
    assert effects.launched == [("m9", "a1"), ("m9", "a2")]
    assert d.of("gpuhedge_races_escalated_total", policy="cascade") == 0  # not yet sent
    driver.submit_attempt("m9", "a2")
    assert d.of("gpuhedge_races_escalated_total", policy="cascade") == 1
    assert d.of("gpuhedge_races_cut_over_total", policy="cascade") == 0


def test_a_loser_whose_cancel_fails_counts_as_a_leak(redis_client, prefix):
    config = RACE_CONFIG.replace("\npolicy:", LEAKY.rstrip() + "\npolicy:", 1)
    driver, effects, cfg, _, _ = build_driver(redis_client, prefix, Recorder(), config=config)
    request = {"sim": {"leaky": {"queue_s": 0, "run_s": 100}, "h": {"queue_s": 0, "run_s": 0}}}
    d = Delta()
    driver.create("m10", request, build_spec(cfg, policy="hedge:leaky->h@0s"))
    driver.submit_attempt("m10", "a1")
    driver.submit_attempt("m10", "a2")  # the hedge wins at once; the primary is cancelled
    driver.cancel_attempt("m10", "a1")  # its cancel endpoint is down: it may still bill
    receipt = driver.store.receipt("m10")
    assert receipt["leaked"] is True and effects.results[0]["winner"] == "h"
    assert d.of("gpuhedge_race_leaks_total", provider="leaky") == 1
    assert d.of("gpuhedge_race_leaks_total", provider="h") == 0
    assert d.of("gpuhedge_race_losers_cancelled_total", provider="leaky",
                evidence="confirmed_terminal") == 0  # fmt: skip


def test_a_race_without_a_valid_result_counts_as_failed_by_reason(setup):
    driver, effects, cfg, _, _ = setup
    d = Delta()
    request = {"sim": {"p": {"queue_s": 0, "run_s": 0, "outcome": "invalid"}}}
    driver.create("m3", request, build_spec(cfg, policy="single:p"))
    driver.submit_attempt("m3", "a1")
    assert effects.failures and effects.results == []
    assert d.of("gpuhedge_races_failed_total", reason="invalid_result") == 1
    assert d.of("gpuhedge_races_started_total", policy="single") == 1
    assert d.of("gpuhedge_race_e2e_seconds_count", policy="single") == 0


def test_a_rate_limited_submit_is_a_provider_error_and_a_failed_race(setup):
    driver, effects, cfg, _, _ = setup
    d = Delta()
    request = {"sim": {"p": {"outcome": "rate_limited"}}}
    driver.create("m4", request, build_spec(cfg, policy="single:p"))
    driver.submit_attempt("m4", "a1")
    assert effects.failures
    assert d.of("gpuhedge_provider_requests_total", provider="p", route="submit") == 1
    assert d.of("gpuhedge_provider_errors_total", provider="p", route="submit",
                kind="rate_limited") == 1  # fmt: skip
    assert d.of("gpuhedge_races_failed_total", reason="submit_failed") == 1


@pytest.mark.parametrize(
    ("half_of_worst_case", "cap"),
    [
        (lambda usd: BudgetCaps(ceiling_usd=usd), "ceiling"),
        (lambda usd: BudgetCaps(max_usd_per_day=usd), "day"),
        (lambda usd: BudgetCaps(max_usd_per_request=usd), "request"),
        (lambda usd: BudgetCaps(providers={"p": ScopeCap(max_usd_total=usd)}), "provider"),
    ],
)
def test_a_refused_reservation_counts_by_cap_kind_and_role(setup, half_of_worst_case, cap):
    driver, effects, cfg, _, _ = setup
    spec = build_spec(cfg, policy="single:p")
    worst = attempt_worst_case_usd(spec.to_dict(), "p")
    assert worst > 0  # the test config bills p: its worst case can pass a cap
    caps = half_of_worst_case(worst / 2)
    driver.budget = RaceBudget(BudgetStore(driver.store.client, driver.store.prefix), caps)
    d = Delta()
    driver.create("m5", FAST, spec)
    driver.submit_attempt("m5", "a1")  # refused: not submitted
    assert effects.failures and effects.results == []
    assert d.of("gpuhedge_budget_refusals_total", cap=cap, role="primary") == 1
    assert d.of("gpuhedge_provider_requests_total", provider="p", route="submit") == 0
    others = {"request", "ceiling", "day", "provider", "key"} - {cap}
    assert all(d.of("gpuhedge_budget_refusals_total", cap=o, role="primary") == 0 for o in others)


def test_a_granted_reservation_counts_no_refusal(setup):
    driver, effects, cfg, _, _ = setup
    spec = build_spec(cfg, policy="single:p")
    caps = BudgetCaps(ceiling_usd=100 * attempt_worst_case_usd(spec.to_dict(), "p"))
    driver.budget = RaceBudget(BudgetStore(driver.store.client, driver.store.prefix), caps)
    d = Delta()
    driver.create("m6", FAST, spec)
    driver.submit_attempt("m6", "a1")
    assert [r["winner"] for r in effects.results] == ["p"]
    assert d.of("gpuhedge_budget_refusals_total", cap="ceiling", role="primary") == 0


def test_a_hedge_the_budget_refused_counts_a_refusal_and_no_hedged_race(setup):
    driver, effects, cfg, _, _ = setup
    spec = build_spec(cfg, policy="hedge:p->h@0s")
    p_worst = attempt_worst_case_usd(spec.to_dict(), "p")
    h_worst = attempt_worst_case_usd(spec.to_dict(), "h")
    caps = BudgetCaps(max_usd_per_request=p_worst + h_worst / 2)  # the primary fits, not both
    driver.budget = RaceBudget(BudgetStore(driver.store.client, driver.store.prefix), caps)
    d = Delta()
    driver.create("m11", {"sim": {"p": {"queue_s": 0, "run_s": 100}}}, spec)
    driver.submit_attempt("m11", "a1")
    assert effects.launched == [("m11", "a1"), ("m11", "a2")]
    driver.submit_attempt("m11", "a2")  # refused: not submitted
    assert d.of("gpuhedge_budget_refusals_total", cap="request", role="hedge") == 1
    assert d.of("gpuhedge_provider_requests_total", provider="h", route="submit") == 0
    assert d.of("gpuhedge_races_hedged_total", policy="hedge") == 0


@pytest.mark.parametrize(
    ("attempts", "reason"),
    [
        ([dict(result_state="COMPLETED", valid=False, submitted_at=0.1)], "invalid_result"),
        ([dict(result_state="TIMEOUT", valid=False, submitted_at=0.1)], "timeout"),
        ([dict(result_state="FAILED", valid=False, submitted_at=None)], "submit_failed"),
        ([dict(result_state="FAILED", valid=False, submitted_at=0.1),
          dict(result_state="FAILED", valid=False, submitted_at=None)], "provider_failed"),
        ([dict(result_state="CANCELLED", valid=None, submitted_at=0.1)], "other"),
    ],
)  # fmt: skip
def test_failure_reasons(attempts, reason):
    assert record.failure_reason([SimpleNamespace(**a) for a in attempts]) == reason


def test_a_timer_handler_counts_its_lag_by_kind(redis_client, prefix):
    store = TimerStore(redis_client, prefix, "metrics")
    service = TimerService(store, lambda timer: None, use_pubsub=False)
    d = Delta()
    now_ms = int(time.time() * 1000)
    store.arm("k1", now_ms - 1500, {"kind": "policy"})  # due 1.5 s ago
    store.arm("k2", now_ms - 10, {"kind": "nothing-we-know"})
    service.run_once()
    assert d.of("gpuhedge_timer_lag_seconds_count", kind="policy") == 1
    assert d.of("gpuhedge_timer_lag_seconds_count", kind="other") == 1
    assert d.of("gpuhedge_timer_lag_seconds_bucket", kind="policy", le="1.0") == 0
    assert d.of("gpuhedge_timer_lag_seconds_bucket", kind="policy", le="2.5") == 1
    assert d.of("gpuhedge_timer_lag_seconds_sum", kind="policy") >= 1.5


def test_janitor_pass_counts_actions_and_cancels():
    from gpuhedge_celery.race.janitor import RaceCleanup

    d = Delta()
    record.janitor_pass(
        [
            RaceCleanup("r1", "ended", cancelled=["a1"], leaked=["a2"], failed=True),
            RaceCleanup("r2", "skipped: owned by another process"),
            RaceCleanup("r3", "forgotten"),
        ]
    )
    assert d.of("gpuhedge_janitor_actions_total", action="ended") == 1
    assert d.of("gpuhedge_janitor_actions_total", action="skipped") == 1
    assert d.of("gpuhedge_janitor_actions_total", action="forgotten") == 1
    assert d.of("gpuhedge_janitor_cancels_total", outcome="confirmed") == 1
    assert d.of("gpuhedge_janitor_cancels_total", outcome="unconfirmed") == 1


def test_every_worker_metric_is_registered_under_its_documented_name():
    names = {family.name for family in REGISTRY.collect()}
    for spec in WORKER_METRICS:
        assert spec.name in names, spec.name
        for label in spec.labels:
            assert label.isidentifier() and not label.endswith("_id"), (spec.name, label)


def test_metrics_off_records_nothing_and_never_imports_prometheus_client():
    code = (
        "import json, os, sys\n"
        "os.environ['GPUHEDGE_METRICS'] = 'off'\n"
        "from gpuhedge_celery.metrics import record\n"
        "record.provider_call('p', 'submit', 'rate_limited')\n"
        "record.pool_waited('default', 1.0)\n"
        "print(json.dumps([record.active(), 'prometheus_client' in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [False, False]


def test_hooks_that_race_the_first_one_are_all_counted():
    # Many threads hit their first hook at once while the metrics are being built: none of
    # their events may be dropped (a fresh interpreter, so the metrics are built here).
    code = (
        "import threading\n"
        "from prometheus_client import REGISTRY\n"
        "import time\n"
        "from gpuhedge_celery.metrics import record\n"
        "build = record._Metrics.__init__\n"
        "def slow_build(self, prom):\n"
        "    build(self, prom)\n"
        "    time.sleep(0.3)  # the others arrive while the first is still building\n"
        "record._Metrics.__init__ = slow_build\n"
        "go = threading.Barrier(16)\n"
        "def hit():\n"
        "    go.wait()\n"
        "    record.provider_call('p', 'submit')\n"
        "threads = [threading.Thread(target=hit) for _ in range(16)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(REGISTRY.get_sample_value('gpuhedge_provider_requests_total',"
        " {'provider': 'p', 'route': 'submit'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == 16


def test_http_adapter_counts_its_calls_and_errors_by_kind():
    from tests.support.http_provider_server import HttpProviderServer
    from tests.test_http import KEY, make

    with HttpProviderServer() as server:
        server.knobs.api_key = KEY
        p = make(server, timeouts={"connect_s": 1, "read_s": 0.3})
        d = Delta()
        server.knobs.submit_errors, server.knobs.error_status = 1, 429
        with pytest.raises(SubmitError):
            p.submit({"text": "hi"})
        handle = p.submit({"text": "hi"})
        server.knobs.status_errors, server.knobs.error_status = 1, 503
        with pytest.raises(ProviderError):
            p.status(handle)
        server.knobs.malformed = {"status"}
        with pytest.raises(ProviderError):
            p.status(handle)
        server.knobs.malformed, server.knobs.status_delay_s = set(), 1.0
        with pytest.raises(ProviderError):
            p.status(handle)
        server.knobs.status_delay_s = 0
        p.status(handle)

    def errors(route: str, kind: str) -> float:
        return d.of("gpuhedge_provider_errors_total", provider="rp", route=route, kind=kind)

    assert d.of("gpuhedge_provider_requests_total", provider="rp", route="submit") == 2
    assert d.of("gpuhedge_provider_requests_total", provider="rp", route="status") == 4
    assert errors("submit", "rate_limited") == 1
    assert [errors("status", k) for k in ("http", "protocol", "timeout")] == [1, 1, 1]
    assert errors("status", "rate_limited") == 0


def test_http_adapter_counts_a_body_it_refused_as_too_big():
    from tests.support.http_provider_server import HttpProviderServer
    from tests.test_http import KEY, make

    with HttpProviderServer() as server:
        server.knobs.api_key, server.knobs.queue_s, server.knobs.run_s = KEY, 0, 0
        p = make(server, max_response_bytes=2_000)  # the finished job's audio is ~43 KB
        d = Delta()
        handle = p.submit({"text": "hi"})
        time.sleep(0.05)
        with pytest.raises(ProviderError, match="max_response_bytes"):
            p.status(handle)

    errors = "gpuhedge_provider_errors_total"
    assert d.of("gpuhedge_provider_requests_total", provider="rp", route="status") == 1
    assert d.of(errors, provider="rp", route="status", kind="protocol") == 1
    assert d.of(errors, provider="rp", route="submit", kind="protocol") == 0
