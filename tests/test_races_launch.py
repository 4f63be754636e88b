"""Inline launches: a hedge submitted on the deciding process's threads, behind a backstop timer.

The driver runs on a real redis-server without Celery (effects recorded, not sent). Each test
plays one thing a crash or a slow provider can do to a launch and checks that the submit happens
exactly once or ends as "outcome unknown", never twice, and that no job is left unknown. The
same launches under real worker processes killed with ``kill -9`` are in test_races_crash.py.
"""

from __future__ import annotations

import time

import pytest

from gpuhedge_celery.core.race_events import SubmitFailed, TimerDue
from gpuhedge_celery.providers.redis_ledger import sim_job_running
from gpuhedge_celery.providers.simledger import seq_key
from gpuhedge_celery.race.attempts import UNKNOWN_SUBMIT, SubmitHow
from gpuhedge_celery.race.backstops import launch_backstop_id
from gpuhedge_celery.race.base import JobRef
from gpuhedge_celery.race.settings import RaceSettings
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.store.timers import Timer
from tests.test_races_driver import Recorder, build_driver

pytestmark = pytest.mark.timeout(60)

SLOW = {"sim": {"p": {"queue_s": 5, "run_s": 100}, "h": {"queue_s": 5, "run_s": 100}}}
BOTH_AT_ONCE = "hedge:p->h@0s"  # the hedge is launched together with the primary


class InlineRecorder(Recorder):
    """Effects that launch in this process (so the driver arms launch backstops): recorded."""

    launches_here = True


@pytest.fixture
def setup(redis_client, prefix):
    return build_driver(redis_client, prefix, InlineRecorder(), RaceSettings(launch_backstop_s=60))


def submits(ledger, provider: str = "h") -> int:
    return int(ledger.get(seq_key(provider)) or 0)


def hedge(driver, race_id: str) -> dict:
    return driver.store.load(race_id).state["race"]["attempts"][1]


def start(driver, cfg, race_id: str) -> None:
    assert driver.create(race_id, SLOW, build_spec(cfg, BOTH_AT_ONCE), submit_first=True)


def fire_backstop(driver, race_id: str, deliveries: int = 1) -> None:
    """Deliver the launch backstop of ``race_id``'s hedge as the timer service would."""
    payload = {"race": race_id, "kind": "launch", "attempt": "a2"}
    timer = Timer(launch_backstop_id(race_id, "a2"), f"{race_id}:l:a2", 0, payload, deliveries, 0)
    driver.on_timer(timer)


def test_a_launch_arms_its_backstop_and_the_watched_submit_drops_it(setup):
    driver, effects, cfg, ledger, _ = setup
    start(driver, cfg, "l1")
    assert effects.launched == [("l1", "a2")]  # the primary was submitted by create itself
    backstop = launch_backstop_id("l1", "a2")
    timers = driver.timers.of("l1")
    due = timers.due_time(backstop)
    assert due is not None and abs(due / 1000 - (time.time() + 60)) < 5
    driver.submit_attempt("l1", "a2", SubmitHow(backstop=backstop))  # what the launch thread runs
    assert submits(ledger) == 1 and hedge(driver, "l1")["phase"] == "running"
    assert timers.due_time(backstop) is None  # dropped with the first watch poll's arm
    watch = "l1:w:a2|"
    waiting = timers.client.zrange(timers.keys.due, 0, -1)
    assert any(w.startswith(watch) for w in waiting), waiting


def test_the_attempt_create_submits_itself_gets_no_launch_backstop(setup):
    """create(submit_first=True) submits the primary in its own thread, covered by the
    redelivered create: a backstop armed for it would never be dropped, and once due it would
    take over the primary's later work (its cancel) from the timer meant for that."""
    driver, effects, cfg, ledger, _ = setup
    start(driver, cfg, "l0")
    primary = driver.store.load("l0").state["race"]["attempts"][0]
    assert submits(ledger, "p") == 1 and primary["phase"] == "running"
    timers = driver.timers.of("l0")
    assert timers.due_time(launch_backstop_id("l0", "a1")) is None
    assert timers.due_time(launch_backstop_id("l0", "a2")) is not None  # launched here
    assert effects.launched == [("l0", "a2")]


def test_a_launch_that_died_before_its_submit_is_made_by_the_backstop(setup):
    driver, _, cfg, ledger, _ = setup
    start(driver, cfg, "l2")  # the launching process dies here: its thread never ran
    fire_backstop(driver, "l2")
    assert submits(ledger) == 1
    a2 = hedge(driver, "l2")
    assert a2["phase"] == "running" and driver.store.live_jobs("l2")["a2"]["job_id"] == a2["job_id"]
    fire_backstop(driver, "l2", deliveries=2)  # delivered again: nothing is submitted again
    driver.submit_attempt(
        "l2", "a2", SubmitHow(backstop=launch_backstop_id("l2", "a2"))
    )  # a late thread
    assert submits(ledger) == 1


def test_a_launch_that_died_after_its_submit_reports_the_registered_job(setup):
    driver, _, cfg, ledger, providers = setup
    start(driver, cfg, "l3")
    handle = providers["h"].submit(SLOW)  # the thread submitted and registered, then died
    driver.store.add_job("l3", "a2", handle.to_dict())
    fire_backstop(driver, "l3")
    assert submits(ledger) == 1
    assert hedge(driver, "l3")["job_id"] == handle.job_id


def test_a_submit_in_flight_elsewhere_is_left_to_it_and_looked_at_again_after_its_window(setup):
    driver, _, cfg, ledger, _ = setup
    start(driver, cfg, "l4")
    now = time.time()
    # another process claimed the submit and is still inside its window
    claimed = driver.store.claim_submit(
        "l4", "a2", {"submitting": True, "at": now, "until": now + 5}
    )
    assert claimed is None
    driver.submit_attempt(
        "l4", "a2", SubmitHow(backstop=launch_backstop_id("l4", "a2"))
    )  # a duplicate
    fire_backstop(driver, "l4")
    assert submits(ledger) == 0 and hedge(driver, "l4")["phase"] == "launching"
    again = f"{launch_backstop_id('l4', 'a2')}|"
    timers = driver.timers.of("l4")
    waiting = [w for w in timers.client.zrange(timers.keys.due, 0, -1)]
    rearmed = [w for w in waiting if w.startswith(again)]
    assert len(rearmed) == 1 and abs(int(rearmed[0].rsplit("|", 1)[1]) / 1000 - (now + 5)) < 1


def test_a_submit_whose_window_passed_ends_as_unknown_never_submitted_again(setup):
    driver, _, cfg, ledger, _ = setup
    start(driver, cfg, "l5")
    then = time.time() - 120  # its process died mid-submit two minutes ago
    driver.store.claim_submit("l5", "a2", {"submitting": True, "at": then, "until": then + 60})
    fire_backstop(driver, "l5")
    a2 = hedge(driver, "l5")
    assert submits(ledger) == 0
    assert a2["phase"] == "ended" and UNKNOWN_SUBMIT in a2["reasons"], a2


def test_only_one_of_two_claims_of_a_submit_wins(setup):
    driver, _, cfg, _, _ = setup
    start(driver, cfg, "l6")
    first = {"submitting": True, "at": 1.0, "until": 2.0}
    assert driver.store.claim_submit("l6", "a2", first) is None
    assert driver.store.claim_submit("l6", "a2", {"submitting": True, "at": 3.0}) == first


def test_a_submit_that_returns_after_its_attempt_ended_cancels_its_job(setup):
    driver, _, cfg, ledger, providers = setup
    start(driver, cfg, "l7")
    real_submit = providers["h"].submit
    made = []

    def slow_submit(request):
        # while the provider call is in flight, the launch is taken for dead elsewhere
        driver.step("l7", SubmitFailed("a2", UNKNOWN_SUBMIT))
        handle = real_submit(request)
        made.append(handle)
        return handle

    providers["h"].submit = slow_submit
    driver.submit_attempt("l7", "a2", SubmitHow(backstop=launch_backstop_id("l7", "a2")))
    assert submits(ledger) == 1 and hedge(driver, "l7")["phase"] == "ended"
    (handle,) = made
    deadline = time.monotonic() + 5  # the sim confirms a cancel 0.35 s (3.5 ms real) later
    while sim_job_running(providers["h"], handle.to_dict()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sim_job_running(providers["h"], handle.to_dict())
    assert ledger.get(f"sim:cancel:h:{handle.job_id}")  # stopped by its native cancel
    assert driver.timers.of("l7").due_time(launch_backstop_id("l7", "a2")) is None


def test_a_watch_reports_a_job_whose_submit_report_was_lost(setup):
    """The first watch poll was armed (and the backstop dropped) in a save that lost its
    version check, and the submitter died before retrying: the watch reports the job."""
    driver, _, cfg, ledger, providers = setup
    start(driver, cfg, "l8")
    handle = providers["h"].submit(SLOW)
    driver.store.add_job("l8", "a2", handle.to_dict())
    assert hedge(driver, "l8")["phase"] == "launching"
    driver.watch(JobRef("l8", "a2", "h", handle.to_dict(), 180.0), "QUEUED-unseen")
    a2 = hedge(driver, "l8")
    assert a2["phase"] == "running" and a2["job_id"] == handle.job_id
    assert submits(ledger) == 1


def test_a_conclusion_reports_a_job_whose_submit_report_was_lost(setup):
    driver, effects, cfg, _, providers = setup
    start(driver, cfg, "l9")
    fast = {"sim": {"h": {"queue_s": 0, "run_s": 0}}}
    handle = providers["h"].submit(fast)
    driver.store.add_job("l9", "a2", handle.to_dict())
    driver.watch(JobRef("l9", "a2", "h", handle.to_dict(), 180.0))  # terminal: concluded at once
    a2 = hedge(driver, "l9")
    assert a2["job_id"] == handle.job_id and a2["valid"] is True
    assert [r["winner"] for r in effects.results] == ["h"]


def test_a_launch_from_a_stale_copy_finds_the_job_another_process_submitted(
    setup, redis_client, prefix
):
    driver, _, cfg, ledger, providers = setup
    start(driver, cfg, "l10")  # this process's copy: a2 launching
    other, *_ = build_driver(redis_client, prefix, InlineRecorder())
    other.providers = providers.__getitem__
    other.submit_attempt("l10", "a2")  # another process got there first
    assert driver.store.load("l10", fresh=True).cached  # ours is now stale
    driver.submit_attempt(
        "l10", "a2", SubmitHow(backstop=launch_backstop_id("l10", "a2"), decided_here=True)
    )
    assert submits(ledger) == 1 and hedge(driver, "l10")["phase"] == "running"
    assert driver.timers.of("l10").due_time(launch_backstop_id("l10", "a2")) is None


def test_a_launch_resumed_where_the_race_was_last_saved_before_it_keeps_its_backstop(
    setup, redis_client, prefix
):
    """A resume (a timer delivered again, a redelivered task) hands a launch still in flight
    elsewhere to this process's launch thread, whose last saved copy of the race predates the
    attempt: the launch is judged from Redis, so the in-flight submit keeps its backstop."""
    driver, _, cfg, ledger, providers = setup
    assert driver.create("l12", SLOW, build_spec(cfg), submit_first=True)  # hedge at 0.3 s
    assert driver.store.load("l12", fresh=True).cached  # this process's copy: a1 only
    other, *_ = build_driver(redis_client, prefix, InlineRecorder(), RaceSettings())
    other.providers = providers.__getitem__
    hedge_at = other.store.load("l12").state["race"]["timers"]["hedge"]
    time.sleep(max(0.0, hedge_at - time.time()) + 0.01)
    other.step("l12", TimerDue("hedge"))  # another process launches a2 (and its backstop)
    now = time.time()
    assert (
        other.store.claim_submit("l12", "a2", {"submitting": True, "at": now, "until": now + 5})
        is None
    )
    backstop = launch_backstop_id("l12", "a2")
    assert driver.timers.of("l12").due_time(backstop) is not None
    driver.submit_attempt(
        "l12", "a2", SubmitHow(backstop=backstop, decided_here=True)
    )  # a resumed launch
    assert driver.timers.of("l12").due_time(backstop) is not None  # left to finish the launch
    assert submits(ledger) == 0 and hedge(driver, "l12")["phase"] == "launching"


def test_an_orphan_job_whose_cancel_fails_stays_registered_for_the_janitor(setup):
    driver, _, cfg, _, providers = setup
    start(driver, cfg, "l11")
    real_submit = providers["h"].submit

    def slow_submit(request):
        driver.step("l11", SubmitFailed("a2", UNKNOWN_SUBMIT))  # taken for dead meanwhile
        return real_submit(request)

    def broken_cancel(handle):
        driver.store.remove_job("l11", "a2")  # the race's finish dropped its ended attempt's job
        raise RuntimeError("provider API down")

    providers["h"].submit = slow_submit
    providers["h"].cancel = broken_cancel
    driver.submit_attempt("l11", "a2", SubmitHow(backstop=launch_backstop_id("l11", "a2")))
    assert hedge(driver, "l11")["phase"] == "ended"
    registered = driver.store.live_jobs("l11")["a2"]
    assert registered["job_id"].startswith("sim-h-") and not registered.get("submitting")
