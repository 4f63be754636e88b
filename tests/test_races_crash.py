"""``kill -9`` of real workers in the middle of hedged races (and of the timers they armed).

Three real coordination workers (threads pool; each consumes ``gpuhedge.coord`` and
``gpuhedge.attempts`` and fires durable timers) race sim providers on compressed time (one
provider second is 10 ms). In each run one race starts and, at a chosen moment, the worker that
holds the work is SIGKILLed: found from its log (the worker that received the race's
``hedged_infer``, ``race_submit`` or ``race_cancel``) or, where nothing records who holds it (a
timer about to fire, a winner just declared), picked at random. A replacement starts in the
background, so the next runs reuse the survivors. The broker's visibility timeout is 2 s here,
so a message the dead worker held comes back within a run.

Invariants checked after every run (20 runs per kill target):

* ``.get()`` returns a winner or raises RaceFailed (never hangs), and the receipt is written;
* one winner: the result, the receipt and the winner claim name the same attempt;
* no provider job is submitted twice: the sim ledger's per-provider submit counters grow by
  exactly the number of attempts the receipt shows as submitted;
* no sim job is left running, no job stays registered as live, nothing leaked;
* duplicate deliveries are harmless: submit and cancel tasks delivered again after the race
  change neither the race's state version nor the submit counters.
"""

from __future__ import annotations

import random
import time

import pytest

from gpuhedge_celery.errors import RaceFailed
from gpuhedge_celery.providers.simledger import seq_key
from tests.support.fixtures_races import start_race_cluster, stop_race_cluster

pytestmark = [pytest.mark.timeout(400), pytest.mark.brokers]

RUNS_PER_TARGET = 20
# The primary is slow (1.5 s real), the hedge launches at 300 ms and wins at ~0.4 s; the
# primary's cancel takes 0.1 s to be acknowledged and 0.25 s to be confirmed.
REQUEST = {
    "sim": {
        "p": {"queue_s": 1, "run_s": 150, "cancel_ack_s": 10, "cancel_terminal_s": 25},
        "h": {"queue_s": 0.5, "run_s": 10},
    }
}
CRASH_ENV = {
    "GPUHEDGE_VISIBILITY_TIMEOUT_S": "2",
    "GPUHEDGE_RESTORE_INTERVAL_S": "0.5",
    # beat runs the janitor every second; a race quiet for 3 s (longer than a redelivery
    # takes) with no timer left is ended by it
    "GPUHEDGE_RECONCILE_INTERVAL_S": "1",
    "GPUHEDGE_JANITOR_STALE_S": "3",
    # a loser's cancel whose process died is taken over after 1 s (the cancel itself takes
    # 0.25 s here), not after the 2 s visibility timeout: cancels are not broker messages
    "GPUHEDGE_CANCEL_BACKSTOP_S": "1",
    # likewise a hedge launch whose process died (its submit takes milliseconds here)
    "GPUHEDGE_LAUNCH_BACKSTOP_S": "1",
}
COORDINATOR_POINTS = ("received", "primary_submitted", "hedge_timer", "winner", "cancelling")
ATTEMPT_POINTS = ("submit_received", "hedge_submitted", "winner", "cancel_received", "cancel_sent")


def _accepted(jobs: dict, attempt_id: str) -> bool:
    """The provider accepted the attempt's job (a handle, not just the submit intent)."""
    return bool(jobs.get(attempt_id)) and not jobs[attempt_id].get("submitting")


class Crasher:
    """Runs races on the cluster and kills workers at chosen moments; keeps 3 workers going."""

    def __init__(self, rc, seed: int, target: str = "coordinator"):
        self.rc = rc
        self.target = target
        self.rng = random.Random(seed)
        self.marks: dict[str, int] = {}
        self.kills: list[str] = []
        self.holder_name = ""
        self.unknown = 0  # submits whose worker died mid-call (ended, never repeated)
        self.janitored = 0  # races the janitor had to end (a message lost with its worker)

    # -- workers ---------------------------------------------------------------------------
    def workers(self):
        return [w for w in self.rc.cluster.workers if w.alive() and "@" in w.nodename]

    def ensure_ready(self, count: int = 2) -> None:
        """Wait until ``count`` live workers are ready, starting a replacement per dead one."""
        alive = self.workers()
        for _ in range(3 - len(alive)):
            self.rc.cluster.start_coordinator(wait=False)
        deadline = time.monotonic() + 60
        while sum(" ready." in w.log() for w in self.workers()) < count:
            assert time.monotonic() < deadline, self.rc.logs()
            time.sleep(0.05)

    def mark_logs(self) -> None:
        self.marks = {w.nodename: len(w.log()) for w in self.workers()}

    def holder(self, needle: str):
        """The live worker whose log got ``needle`` since :meth:`mark_logs`, if any."""
        for w in self.workers():
            if needle in w.log()[self.marks.get(w.nodename, 0) :]:
                self.holder_name = w.nodename
                return w
        return None

    def kill(self, worker, point: str) -> None:
        worker = worker or self.rng.choice(self.workers())
        worker.kill()
        worker.process.wait(10)
        self.kills.append(f"{point}:{worker.nodename}")

    # -- one run ---------------------------------------------------------------------------
    def state(self, race_id):
        record = self.rc.store.load(race_id)
        return None if record is None else record.state

    def phase(self, state, attempt_id):
        for a in (state or {}).get("race", {}).get("attempts", []):
            if a["id"] == attempt_id:
                return a["phase"]
        return None

    def wait_and_kill(self, race_id: str, point: str) -> None:
        """Poll the race until ``point`` is reached, then kill the worker holding the work."""
        rc = self.rc
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = self.state(race_id)
            coord = self.holder(f"hedged_infer[{race_id}] received")
            if point == "received" and coord is not None:
                return self.kill(coord, point)
            jobs = rc.store.live_jobs(race_id)
            if point == "primary_submitted" and _accepted(jobs, "a1"):
                return self.kill(coord, point)
            if point == "hedge_armed" and state and "hedge" in state["race"]["timers"]:
                return self.kill(coord, point)
            if point == "hedge_timer" and state and "hedge" in state["race"]["timers"]:
                if time.time() >= state["race"]["timers"]["hedge"] - 0.02:
                    return self.kill(None, point)
            if point == "winner" and rc.store.winner(race_id) is not None:
                attempt_worker = self.target == "attempt"
                return self.kill(self.holder("race_cancel[") if attempt_worker else None, point)
            if point == "cancelling" and self.phase(state, "a1") == "cancelling":
                return self.kill(self.holder("race_cancel["), point)
            submit = self.holder("race_submit[")
            if point == "submit_received" and submit is not None:
                return self.kill(submit, point)
            if point == "hedge_submitted" and _accepted(jobs, "a2"):
                return self.kill(submit, point)
            cancel = self.holder("race_cancel[")
            if point == "cancel_received" and cancel is not None:
                return self.kill(cancel, point)
            if point == "cancel_sent" and cancel is not None:
                job = ((state or {}).get("race", {}).get("attempts") or [{}])[0].get("job_id")
                if job and rc.ledger.get(f"sim:cancel:p:{job}"):
                    return self.kill(cancel, point)
            if state and state["race"].get("finished"):
                break
            time.sleep(0.003)
        self.kills.append(f"{point}:missed")  # the race ran past the point; still checked

    def submits(self) -> dict[str, int]:
        return {p: int(self.rc.ledger.get(seq_key(p)) or 0) for p in ("p", "h")}

    def run(self, point: str) -> dict:
        rc = self.rc
        self.ensure_ready()
        self.mark_logs()
        before = self.submits()
        res = rc.send(REQUEST)
        self.wait_and_kill(res.id, point)
        try:
            result = res.get(timeout=30)
        except RaceFailed as e:
            result = None
            assert e.receipt["race_id"] == res.id
        except Exception:
            print("stuck race", res.id, self.state(res.id), rc.store.receipt(res.id))
            print("meta", rc.app.backend.get_task_meta(res.id))
            raise
        try:
            receipt = rc.receipt(res.id, timeout=30)
        except AssertionError:
            print("no receipt", res.id, self.state(res.id), rc.store.live_jobs(res.id))
            raise
        # one winner, the same everywhere
        if result is not None:
            assert result["race_id"] == res.id
            assert receipt["winner"] == result["attempt"] == rc.store.winner(res.id)
        else:
            assert receipt["winner"] is None and rc.store.winner(res.id) is None
        # no job submitted twice, none unknown to the receipt
        grew = {p: n - before[p] for p, n in self.submits().items()}
        # an attempt whose worker died mid-submit is never submitted again (its outcome is
        # unknown, so it counts as at most one submit)
        shown = {p: sum(1 for a in receipt["attempts"] if a["provider"] == p and a["handle"])
                 for p in ("p", "h")}  # fmt: skip
        unknown = {p: sum(1 for a in receipt["attempts"] if a["provider"] == p
                          and any("outcome unknown" in r for r in a["reasons"]))
                   for p in ("p", "h")}  # fmt: skip
        self.unknown += sum(unknown.values())
        self.janitored += bool(receipt.get("janitor"))
        for p in grew:
            assert shown[p] <= grew[p] <= shown[p] + unknown[p], (point, grew, receipt["attempts"])
        assert all(n <= 1 for n in grew.values())
        # nothing left running, registered or leaked
        assert rc.running_sim_jobs(receipt) == []
        assert rc.store.live_jobs(res.id) == {}
        # ... except a submit whose outcome is unknown: flagged, since no id can cancel it
        unknown_ids = {a["id"] for a in receipt["attempts"]
                       if any("outcome unknown" in r for r in a["reasons"])}  # fmt: skip
        assert {leak["attempt"] for leak in receipt["leaks"]} == unknown_ids
        assert receipt["finished"] is True
        # duplicate deliveries of attempt tasks change nothing
        version = rc.store.load(res.id).version
        for name in ("gpuhedge.race_submit", "gpuhedge.race_cancel"):
            for attempt in receipt["attempts"]:
                rc.app.send_task(
                    name, (res.id, attempt["id"], attempt["provider"]), queue="gpuhedge.attempts"
                ).get(timeout=30)
        assert rc.store.load(res.id).version == version
        assert self.submits() == {p: before[p] + grew[p] for p in grew}
        return receipt


@pytest.fixture(scope="module")
def crash_cluster(redis_url, tmp_path_factory, broker, request):
    from gpuhedge_celery.store.connection import redis_from_url
    from gpuhedge_celery.store.listener import enable_notifications
    from tests.support.fixtures_celery import broker_url_for

    enable_notifications(redis_from_url(redis_url))
    rc = start_race_cluster(
        redis_url, tmp_path_factory.mktemp("crash"), workers=3,
        broker_url=broker_url_for(broker, request), **CRASH_ENV,
    )  # fmt: skip
    rc.cluster.start_beat()
    yield rc
    stop_race_cluster(rc)


def test_hedge_timer_survives_the_worker_that_armed_it(crash_cluster):
    """Killed right after arming, its hedge timer fires on a survivor on time, not after 2 s."""
    rc = crash_cluster
    crasher = Crasher(rc, seed=7)
    for _ in range(2):
        crasher.ensure_ready(3)
        crasher.mark_logs()
        res = rc.send(REQUEST)
        crasher.wait_and_kill(res.id, "hedge_armed")
        assert not crasher.kills[-1].endswith("missed")
        assert crasher.kills[-1].endswith(crasher.holder_name)
        assert res.get(timeout=30)["winner"] == "h"
        receipt = rc.receipt(res.id)
        primary, hedge = receipt["attempts"]
        due = primary["submitted_at_s"] + 0.3  # the hedge timer: 300 ms after the submit
        # fired by a survivor well within the timer lease (10 s) and before the 2 s
        # visibility timeout would redeliver it; the margin covers a loaded machine
        assert 0 <= hedge["launched_at_s"] - due < 1.5, (primary, hedge)


def test_a_cancel_dies_with_its_worker_and_the_backstop_timer_finishes_it(crash_cluster):
    """Killed while it cancels a loser natively, the cancel is finished by a survivor."""
    rc = crash_cluster
    crasher = Crasher(rc, seed=11)
    for _ in range(3):
        crasher.ensure_ready(3)
        crasher.mark_logs()
        res = rc.send(REQUEST)
        crasher.wait_and_kill(res.id, "cancel_sent")
        if crasher.kills[-1].endswith("missed"):
            continue
        assert res.get(timeout=30)["winner"] == "h"
        receipt = rc.receipt(res.id, timeout=30)
        primary = receipt["attempts"][0]
        assert primary["phase"] == "cancelled" and receipt["leaks"] == []
        cancel = primary["cancel_receipt"]
        assert cancel["evidence"] == "confirmed_terminal" and not cancel["leaked"], cancel
        assert rc.running_sim_jobs(receipt) == []
        survivors = "".join(w.log() for w in crasher.workers())
        assert f"race {res.id}: cancel of a1 taken over by the backstop timer" in survivors
        return
    pytest.fail(f"never caught a cancel in flight: {crasher.kills}")


def test_a_hedge_launch_dies_with_its_worker_and_the_backstop_timer_ends_it(crash_cluster):
    """Killed while it submits the hedge (a slow job API), the launch is taken over by a
    survivor's backstop timer; the submit's outcome is unknown, so it is never repeated."""
    rc = crash_cluster
    crasher = Crasher(rc, seed=13)
    slow_api = {**REQUEST["sim"]["h"], "submit_s": 100}  # the submit call takes 1 s real
    request = {"sim": {**REQUEST["sim"], "h": slow_api}}
    crasher.ensure_ready(3)
    crasher.mark_logs()
    before = crasher.submits()
    res = rc.send(request)
    deadline = time.monotonic() + 10
    # the launching worker has claimed the submit (its intent is registered) and is in the call
    while (launcher := crasher.holder(f"race_submit[{res.id}:a2]")) is None or not (
        rc.store.live_jobs(res.id).get("a2") or {}
    ).get("submitting"):
        assert time.monotonic() < deadline, rc.logs()
        time.sleep(0.005)
    crasher.kill(launcher, "launching")
    assert not _accepted(rc.store.live_jobs(res.id), "a2")  # killed inside the submit call
    assert res.get(timeout=30)["winner"] == "p"  # the primary ends at 1.5 s
    receipt = rc.receipt(res.id, timeout=30)
    hedge = receipt["attempts"][1]
    assert hedge["handle"] is None and any("outcome unknown" in r for r in hedge["reasons"])
    now = crasher.submits()  # the hedge's request may or may not have reached the provider
    assert now["p"] == before["p"] + 1 and before["h"] <= now["h"] <= before["h"] + 1
    assert rc.running_sim_jobs(receipt) == [] and rc.store.live_jobs(res.id) == {}
    survivors = "".join(w.log() for w in crasher.workers())
    assert f"race {res.id}: launch of a2 taken over by the backstop timer" in survivors


@pytest.mark.parametrize(
    ("target", "points"), [("coordinator", COORDINATOR_POINTS), ("attempt", ATTEMPT_POINTS)]
)
def test_kill_9_at_any_point_keeps_every_invariant(crash_cluster, target, points):
    crasher = Crasher(crash_cluster, seed=len(target), target=target)
    outcomes = []
    try:
        for i in range(RUNS_PER_TARGET):
            receipt = crasher.run(points[i % len(points)])
            outcomes.append(receipt["winner_provider"])
    except Exception:
        print("kills:", crasher.kills)
        print(crash_cluster.logs())
        raise
    print(f"{target}: kills {crasher.kills}; unknown submits {crasher.unknown}; "
          f"ended by the janitor {crasher.janitored}")  # fmt: skip
    missed = [k for k in crasher.kills if k.endswith(":missed")]
    assert len(missed) <= RUNS_PER_TARGET // 4, crasher.kills  # most runs really crashed
    assert len(outcomes) == RUNS_PER_TARGET
