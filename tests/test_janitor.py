"""The race janitor on real workers: kill every worker mid-race, then clean up what they left.

Two races wait on long sim jobs (primary and hedge both running) when every worker is killed
with SIGKILL. Nobody will ever advance them, so their paid jobs would run on unless the janitor
ends them: run directly (a script after a full outage) for one race and through the
``gpuhedge.janitor`` task on a fresh worker for the other. Each race must end as an explicit
failure (``.get()`` raises RaceFailed carrying the receipt), with every job cancelled through
the sim's native cancel and a confirmed receipt, and nothing left running or registered.
"""

from __future__ import annotations

import threading
import time

import pytest

from gpuhedge_celery.core.race import Race
from gpuhedge_celery.core.receipts import CancelReceipt
from gpuhedge_celery.errors import RaceFailed
from gpuhedge_celery.race.janitor import ABANDONED_NOTE, Janitor, JanitorOptions, apply_cleanup
from gpuhedge_celery.store.timers import RaceTimers
from tests.support.fixtures_celery import broker_url_for
from tests.support.fixtures_races import start_race_cluster, stop_race_cluster
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(150), pytest.mark.brokers, pytest.mark.cluster]

# both jobs would run 100 s of real time: they are still running when the janitor comes
LONG = {"sim": {"p": {"queue_s": 0, "run_s": 10_000}, "h": {"queue_s": 0, "run_s": 10_000}}}


class BackendEffects:
    """What the Celery effects do for a janitor, through the test cluster's own app."""

    def __init__(self, app):
        self.app = app
        self.failed_races: list[str] = []

    def launch(self, race_id, attempt_id, provider):  # pragma: no cover - never called
        raise AssertionError("the janitor never launches")

    def cancel(self, race_id, attempt_id, provider):  # pragma: no cover - never called
        raise AssertionError("the janitor cancels natively, not through tasks")

    def won(self, race_id, result, caller):
        self.app.backend.mark_as_done(race_id, result)

    def failed(self, race_id, message, receipt, caller):
        error = RaceFailed(message, receipt)
        self.app.backend.mark_as_failure(race_id, error)
        self.failed_races.append(race_id)

    def event(self, race_id, name, fields):
        pass


def both_running(rc, race_id):
    record = rc.store.load(race_id)
    if record is None:
        return False
    phases = [a["phase"] for a in record.state["race"]["attempts"]]
    return phases == ["running", "running"] and len(rc.store.live_jobs(race_id)) == 2


def assert_ended_by_janitor(rc, res):
    with pytest.raises(RaceFailed) as info:
        res.get(timeout=20)
    receipt = rc.store.receipt(res.id)
    assert receipt is not None and info.value.receipt["race_id"] == res.id
    assert receipt["winner"] is None and receipt["note"] == ABANDONED_NOTE
    assert receipt["finished"] is True and receipt["leaks"] == []
    for attempt in receipt["attempts"]:
        cancel = attempt["cancel_receipt"]
        assert attempt["phase"] == "cancelled"
        assert cancel["evidence"] == "confirmed_terminal" and cancel["leaked"] is False
        assert cancel["terminal_status"] == "CANCELLED" and cancel["note"].startswith("janitor")
    assert rc.running_sim_jobs(receipt) == []
    assert rc.store.live_jobs(res.id) == {}
    assert rc.store.last_seen_ms(res.id) is None  # left the janitor's index


def test_janitor_ends_races_whose_workers_all_died(redis_url, tmp_path_factory, broker, request):
    rc = start_race_cluster(
        redis_url, tmp_path_factory.mktemp("janitor"), workers=1,
        broker_url=broker_url_for(broker, request),
    )  # fmt: skip
    try:
        direct, via_task = rc.send(LONG), rc.send(LONG)
        wait_for(lambda: both_running(rc, direct.id) and both_running(rc, via_task.id), 20,
                 "both races to have two running jobs")  # fmt: skip
        for worker in rc.cluster.workers:
            worker.kill()
            worker.process.wait(10)
        timers = RaceTimers(rc.client, rc.store.shards)
        effects = BackendEffects(rc.app)

        def providers(name):
            return rc.config.build(name, ledger=rc.ledger)

        def janitor(alive: bool) -> Janitor:
            options = JanitorOptions(stale_ms=300, coordinators_alive=lambda: alive)
            return Janitor(rc.store, timers, providers, effects, options)

        # While some coordinator is alive, a race with a waiting timer is not dead.
        time.sleep(0.4)
        assert janitor(True).clean(direct.id).action.startswith("skipped: a timer")
        # No coordinator: two passes at once clean it once, under the race's ownership lease.
        results, errors = [], []

        def one_pass() -> None:
            try:
                results.append(janitor(False).clean(direct.id))
            except Exception as e:  # surfaced below, with the other pass's answer
                errors.append(e)

        threads = [threading.Thread(target=one_pass) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        actions = sorted(r.action for r in results)
        assert "ended" in actions, actions
        assert effects.failed_races == [direct.id]
        assert_ended_by_janitor(rc, direct)
        assert janitor(False).clean(direct.id).action in (
            "forgotten",
            "skipped: advanced since the scan",
        )

        # The other race through the beat task on a fresh worker. Its timers are gone (as with
        # a Redis that lost them), so nothing else will ever advance it: only the janitor can.
        keys = timers.of(via_task.id).keys
        rc.client.delete(keys.due, keys.inflight, keys.data, keys.chains)
        rc.cluster.start_coordinator(GPUHEDGE_JANITOR_STALE_S="0.3")
        report = rc.app.send_task("gpuhedge.janitor", queue="gpuhedge.coord").get(timeout=30)
        mine = [r for r in report["races"] if r["race_id"] == via_task.id]
        assert mine and mine[0]["action"] == "ended" and mine[0]["failed"] is True, report
        assert sorted(mine[0]["cancelled"]) == ["a1", "a2"]
        assert_ended_by_janitor(rc, via_task)
        again = rc.app.send_task("gpuhedge.janitor", queue="gpuhedge.coord").get(timeout=30)
        assert again["cancelled"] == 0 and again["ended"] == 0  # idempotent
    except Exception:
        print(rc.logs())
        raise
    finally:
        stop_race_cluster(rc)


def _race_with(attempts):
    from gpuhedge_celery.core.clock import VirtualClock
    from gpuhedge_celery.core.policies import parse_policy

    race = Race(parse_policy("hedge:p->h@1s"), VirtualClock(100.0))
    race.start()
    race.attempts = attempts
    return race


def test_apply_cleanup_table():
    """Pure: launched-not-submitted ends unsubmitted, confirmed -> cancelled, errors -> leaked."""
    from gpuhedge_celery.core.attempts import Attempt, Phase
    from gpuhedge_celery.core.jobs import JobState

    launching = Attempt("a1", "p", "primary", 0.0)
    running = Attempt("a2", "h", "hedge", 0.1, phase=Phase.RUNNING, job_id="j2")
    broken = Attempt("a3", "f", "fallback", 0.2, phase=Phase.RUNNING, job_id="j3")
    race = _race_with([launching, running, broken])
    ok = CancelReceipt(provider="h", job_id="j2")
    ok.confirm_terminal(JobState.CANCELLED, 100_500.0)
    late = {"provider": "p", "job_id": "j1", "submitted_at": 100.0, "extra": {}}
    apply_cleanup(race, {"a2": ok, "a3": "HTTPError: 503"}, 100_600.0, {"a1": late})
    assert race.finished and race.winner is None and race.note == ABANDONED_NOTE
    assert launching.phase is Phase.ENDED and launching.cancel_requested
    assert launching.handle == late and launching.job_id == "j1"  # registered, never reported
    assert running.phase is Phase.CANCELLED and running.receipt is ok
    assert broken.phase is Phase.LEAKED and broken.receipt.leaked
    assert "503" in broken.receipt.note and "leaked" in race.flags
    assert race.timers == {}


def test_apply_cleanup_ends_a_submit_left_mid_call_as_unknown():
    from gpuhedge_celery.core.attempts import Attempt, Phase
    from gpuhedge_celery.race.attempts import UNKNOWN_SUBMIT

    launching = Attempt("a1", "p", "primary", 0.0)
    race = _race_with([launching])
    apply_cleanup(race, {"a1": UNKNOWN_SUBMIT}, 100_600.0)
    assert launching.phase is Phase.ENDED and launching.reasons == [UNKNOWN_SUBMIT]
    assert race.finished and "leaked" not in race.flags


def test_jobs_that_may_still_run_are_the_ones_cancelled():
    """Live attempts, capped ones (TIMEOUT is our deadline) and unknown ones need a cancel."""
    from gpuhedge_celery.core.attempts import Attempt, Phase
    from gpuhedge_celery.race.janitor import _may_run

    capped = Attempt("a1", "p", "primary", 0.0, phase=Phase.ENDED, result_state="TIMEOUT")
    done = Attempt("a2", "h", "hedge", 0.1, phase=Phase.ENDED, result_state="COMPLETED")
    cancelled = Attempt("a3", "f", "fallback", 0.2, phase=Phase.CANCELLED)
    cancelling = Attempt("a4", "f", "fallback", 0.3, phase=Phase.CANCELLING)
    race = _race_with([capped, done, cancelled, cancelling])
    assert [_may_run(race, i) for i in ("a1", "a2", "a3", "a4", "a9")] == [
        True, False, False, True, True,
    ]  # fmt: skip
    ok = CancelReceipt(provider="p", job_id="j1")
    apply_cleanup(race, {"a1": ok}, 100_600.0)
    assert capped.phase is Phase.ENDED and capped.receipt is ok  # it keeps its TIMEOUT result
