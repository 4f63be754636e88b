"""What Flower sees of races: a ``celery events`` state fed by an event receiver on the broker.

Flower builds its task list from task events, exactly like :class:`celery.events.state.State`
does here. The worker runs with task events on (``-E``, given as ``CELERY_WORKER_TASK_EVENTS``)
so Celery's own events (received, started, ...) arrive beside the race's custom ones, and each
custom ``task-<name>`` event becomes the task state ``<NAME>`` in that view.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from gpuhedge_celery.errors import ProviderError
from gpuhedge_celery.providers.sim import SimProvider
from tests.support.fixtures_races import RACE_CONFIG, start_race_cluster, stop_race_cluster
from tests.support.waiting import wait_until_subscribed

pytestmark = [pytest.mark.timeout(120), pytest.mark.cluster]

HEDGE_RESCUE = {"sim": {"p": {"queue_s": 2, "run_s": 100}, "h": {"queue_s": 0.5, "run_s": 4}}}
CASCADE = {
    "sim": {
        "p": {"queue_s": 30, "run_s": 5},
        "h": {"queue_s": 60, "run_s": 5},
        "f": {"queue_s": 0.2, "run_s": 3},
    }
}


class NoCancelSim(SimProvider):
    """A sim provider whose native cancel always fails: its losers leak (the LEAKED state)."""

    def cancel(self, handle):
        raise ProviderError(self.name, "simulated: the cancel endpoint is down")


# the test config plus ``leaky``, a primary built from the class above (adapter "module:Class")
LEAKY = """
  leaky:
    role: primary
    adapter: tests.test_flower_events:NoCancelSim
"""


@pytest.fixture(scope="module")
def events_cluster(redis_url, tmp_path_factory, broker, request):
    from tests.support.fixtures_celery import broker_url_for

    tmp = tmp_path_factory.mktemp("flower")
    config = tmp / "flower.yaml"
    # appended after the other providers, so each role's first provider stays the same
    config.write_text(RACE_CONFIG.replace("\npolicy:", LEAKY.rstrip() + "\npolicy:", 1))
    rc = start_race_cluster(
        redis_url, tmp, workers=1, broker_url=broker_url_for(broker, request),
        CELERY_WORKER_TASK_EVENTS="1", GPUHEDGE_CONFIG=str(config),
    )  # fmt: skip
    assert "task events: ON" in rc.cluster.workers[0].log()  # the worker really runs with -E
    yield rc
    stop_race_cluster(rc)


class EventLog:
    """An event receiver on the test broker, collecting every event in a thread."""

    def __init__(self, app):
        self.app = app
        self.events: list[dict] = []
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._listen, daemon=True)

    def _listen(self) -> None:
        with self.app.connection_for_read() as conn:
            receiver = self.app.events.Receiver(conn, handlers={"*": self.events.append})
            self.ready.set()
            while not self.stop.is_set():
                try:
                    for _ in receiver.itercapture(limit=None, timeout=0.5, wakeup=False):
                        if self.stop.is_set():
                            return
                except TimeoutError:  # a quiet half second: look at the stop flag again
                    continue

    def __enter__(self) -> EventLog:
        self.thread.start()
        assert self.ready.wait(10)
        wait_until_subscribed(self.app, self.events)  # before anything is sent
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)

    def wait_for(self, race_id: str, wanted: set[str], timeout: float = 15) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            mine = [e for e in list(self.events) if e.get("uuid") == race_id]
            if wanted <= {e["type"] for e in mine}:
                return mine
            time.sleep(0.05)
        seen = [e["type"] for e in self.events if e.get("uuid") == race_id]
        raise AssertionError(f"missing {wanted - set(seen)}; seen {seen}")


def states_of(events: list[dict], race_id: str):
    """Feed the events to Celery's State one by one; the task states it went through."""
    from celery.events.state import State

    state = State()
    seen = []
    for event in events:
        state.event(event)
        task = state.tasks.get(race_id)
        if task is not None and (not seen or seen[-1] != task.state):
            seen.append(task.state)
    return state, seen


def test_a_hedge_rescue_shows_its_lifecycle_as_task_states(events_cluster):
    rc = events_cluster
    with EventLog(rc.app) as log:
        res = rc.send(HEDGE_RESCUE)
        assert res.get(timeout=20)["winner"] == "h"
        rc.receipt(res.id)
        wanted = {"task-received", "task-queued", "task-running", "task-hedge_launched",
                  "task-won", "task-loser_cancelled", "task-succeeded"}  # fmt: skip
        mine = log.wait_for(res.id, wanted)
        everything = list(log.events)
    state, seen = states_of(everything, res.id)
    for name in ("QUEUED", "RUNNING", "HEDGE_LAUNCHED", "WON", "SUCCESS"):
        assert name in seen, seen
    assert seen.index("HEDGE_LAUNCHED") < seen.index("WON") <= seen.index("SUCCESS")
    task = state.tasks[res.id]
    assert task.name == "gpuhedge.hedged_infer"  # from the task-received the race sent
    launched = next(e for e in mine if e["type"] == "task-hedge_launched")
    assert launched["provider"] == "h" and launched["role"] == "hedge"
    assert launched["race_id"] == res.id
    cancelled = next(e for e in mine if e["type"] == "task-loser_cancelled")
    assert cancelled["provider"] == "p" and cancelled["job_id"].startswith("sim-p-")
    # the attempt tasks are named by race and provider in their arguments (Flower's task list)
    submits = [t for t in state.tasks.values() if t.name == "gpuhedge.race_submit"]
    assert any(res.id in (t.args or "") and "'h'" in (t.args or "") for t in submits), [
        (t.name, t.args) for t in submits
    ]


def test_a_cascade_shows_cut_over_and_escalated(events_cluster):
    rc = events_cluster
    with EventLog(rc.app) as log:
        res = rc.send(CASCADE, policy="cascade")
        assert res.get(timeout=20)["winner"] == "f"
        rc.receipt(res.id)
        mine = log.wait_for(res.id, {"task-cut_over", "task-escalated", "task-won"})
    _, seen = states_of(mine, res.id)
    assert "CUT_OVER" in seen and "ESCALATED" in seen and "WON" in seen, seen
    escalated = next(e for e in mine if e["type"] == "task-escalated")
    assert escalated["provider"] == "f" and escalated["role"] == "fallback"


def test_a_cancel_that_fails_shows_leaked(events_cluster):
    """A loser's cancel fails before the result: LEAKED shows as the task's state."""
    rc = events_cluster
    with EventLog(rc.app) as log:
        request = {"sim": {"leaky": {"queue_s": 0, "run_s": 100, "outcome": "ok"},
                           "h": {"queue_s": 0.5, "run_s": 4}}}  # fmt: skip
        # the test policy cancels the primary at 30 ms (it fails: leaked) and launches the hedge
        res = rc.send(request, policy="cancel_at:leaky->h@30ms")
        assert res.get(timeout=20)["winner"] == "h"
        mine = log.wait_for(res.id, {"task-leaked", "task-won", "task-succeeded"})
    _, seen = states_of(mine, res.id)
    assert "LEAKED" in seen and seen.index("LEAKED") < seen.index("WON"), seen
    leaked = next(e for e in mine if e["type"] == "task-leaked")
    assert leaked["provider"] == "leaky" and leaked["job_id"].startswith("sim-leaky-")


FAILS = {"sim": {"p": {"queue_s": 0, "run_s": 1, "outcome": "failed"},
                 "h": {"queue_s": 0, "run_s": 1, "outcome": "failed"}}}  # fmt: skip


def test_flower_runtime_is_the_races_duration(events_cluster):
    """``hedged_infer`` returns at once, so Celery's own runtime would be about 0 for every
    race: the race's task-succeeded carries the race's duration (its ``e2e_ms``), and its
    task-failed the time from its start to its failure, which Flower shows as Runtime."""
    from gpuhedge_celery.errors import RaceFailed

    rc = events_cluster
    with EventLog(rc.app) as log:
        sent = time.monotonic()
        won = rc.send(HEDGE_RESCUE)
        result = won.get(timeout=20)
        won_wall = time.monotonic() - sent
        sent = time.monotonic()
        lost = rc.send(FAILS)
        with pytest.raises(RaceFailed):
            lost.get(timeout=20)
        lost_wall = time.monotonic() - sent
        mine = log.wait_for(won.id, {"task-succeeded"}) + log.wait_for(lost.id, {"task-failed"})
    succeeded = next(e for e in mine if e["type"] == "task-succeeded")
    assert succeeded["runtime"] == pytest.approx(result["e2e_ms"] / 1000.0)
    assert 0 < succeeded["runtime"] < won_wall
    failed = next(e for e in mine if e["type"] == "task-failed")
    assert 0 < failed["runtime"] < lost_wall
    state, _ = states_of(mine, won.id)
    assert state.tasks[won.id].runtime == succeeded["runtime"]  # what Flower's list shows
    assert state.tasks[lost.id].runtime == failed["runtime"]


def test_task_events_show_a_requests_size_not_its_content(events_cluster):
    rc = events_cluster
    private = {**HEDGE_RESCUE, "patient": {"ssn": "123-45-6789", "name": "Ada Example"}}
    with EventLog(rc.app) as log:
        res = rc.send(private)
        assert res.get(timeout=20)["winner"] == "h"
        log.wait_for(res.id, {"task-received", "task-succeeded"})
        everything = list(log.events)
    text = repr(everything)
    assert "123-45-6789" not in text and "Ada Example" not in text
    received = next(e for e in everything if e.get("uuid") == res.id
                    and e["type"] == "task-received")  # fmt: skip
    assert re.fullmatch(r"\(<request: [\d,]+ bytes>\)", received["args"]), received["args"]


def test_published_and_received_reprs_of_a_request_carrying_task_are_summaries():
    from types import SimpleNamespace

    from gpuhedge_celery.tasks import redaction
    from gpuhedge_celery.tasks.app import TASK_POOLED_INFER

    request = {"ssn": "123-45-6789"}
    headers = {"argsrepr": repr((request,)), "kwargsrepr": repr({"pool": "p"})}
    redaction._redact_published(  # noqa: SLF001
        sender=TASK_POOLED_INFER, body=((request,), {"pool": "p"}, {}), headers=headers
    )
    assert "123-45-6789" not in repr(headers) and "'pool': 'p'" in headers["kwargsrepr"]
    received = SimpleNamespace(name=TASK_POOLED_INFER, args=(), kwargs={"request": request},
                               _argsrepr="", _kwargsrepr=repr({"request": request}))  # fmt: skip
    redaction._redact_received(request=received)  # noqa: SLF001
    assert received._kwargsrepr == "{'request': '<request: 21 bytes>'}"  # noqa: SLF001
    other = {"argsrepr": "('r1', 'a1')"}
    redaction._redact_published(sender="gpuhedge.race_step", body=(("r1",), {}, {}), headers=other)  # noqa: SLF001
    assert other == {"argsrepr": "('r1', 'a1')"}  # tasks without a request keep their reprs


def test_inspect_shows_a_request_carrying_tasks_summaries_not_its_arguments():
    from gpuhedge_celery.tasks.redaction import RedactedRequest

    class Probe(RedactedRequest):  # the fields info() reads, without a broker message
        def __init__(self):
            self.id, self.name, self._type, self._hostname = "t1", "gpuhedge.pooled_infer", "", "w"
            self._args, self._kwargs = ({"ssn": "123-45-6789"},), {"pool": "p"}
            self._argsrepr, self._kwargsrepr = "(<request: 23 bytes>,)", "{'pool': 'p'}"
            self.time_start, self.worker_pid = None, None

        acknowledged = False
        delivery_info: dict = {}

    info = Probe().info(safe=False)  # what inspect active / reserved answer with
    assert info["args"] == "(<request: 23 bytes>,)" and "123-45-6789" not in repr(info)
