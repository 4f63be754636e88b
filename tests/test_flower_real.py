"""What a real Flower process shows of races: Flower on the workers' broker, read through its API.

``tests/test_flower_events.py`` feeds Celery's event ``State`` from a receiver in the test; here
``celery -A gpuhedge_celery flower`` runs as its own process, with the workers' environment (the
same Redis, the same broker key prefix), and the test polls its HTTP API as a user would:
``/api/task/info/<race id>`` for the race's task, ``/api/tasks`` for its task list and
``/metrics`` for the events it has processed. The worker runs with task events on (``-E``, given
as ``CELERY_WORKER_TASK_EVENTS``), as a Flower user's would; the race's name and arguments come
from the ``task-received`` the race sends itself. Flower must start: if it cannot, the fixture
fails the tests (it never skips them).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gpuhedge_celery.errors import RaceFailed
from tests.support.fixtures_races import (
    RACE_CONFIG,
    RaceCluster,
    start_race_cluster,
    stop_race_cluster,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)

# Provider seconds are 10 ms real. The primary queues 0.1 s then runs 10 s (it loses); the hedge,
# launched at 0.2 s real, queues 1 s and runs 1.5 s: the race's task stays in a custom state
# (HEDGE_LAUNCHED, QUEUED, RUNNING) for ~2.5 s before it is WON and SUCCESS.
SLOW_HEDGE = {"sim": {"p": {"queue_s": 10, "run_s": 1000}, "h": {"queue_s": 100, "run_s": 150}}}
SLOW_HEDGE_POLICY = "hedge:p->h@0.2s"  # a full policy name: real time, not scaled
NOTHING_VALID = {
    "sim": {
        "p": {"queue_s": 20, "run_s": 30, "outcome": "failed"},
        "h": {"queue_s": 20, "run_s": 30, "outcome": "failed"},
    }
}
POLL_S = 0.05
RACE = "gpuhedge.hedged_infer"
CUSTOM = ("HEDGE_LAUNCHED", "QUEUED", "RUNNING", "WON")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Flower:
    """A running Flower process, its HTTP client and the race cluster it watches."""

    rc: RaceCluster
    process: subprocess.Popen
    http: httpx.Client
    log_path: Path

    def log(self) -> str:
        """The end of Flower's log, without its 404 lines (each poll of a task not known yet)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(line for line in lines if " 404 GET " not in line)[-4000:]

    def task(self, task_id: str) -> dict | None:
        """Flower's view of one task (``/api/task/info``); None while Flower does not know it."""
        response = self.http.get(f"/api/task/info/{task_id}")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json()

    def watch(self, task_id: str, timeout_s: float = 20) -> list[tuple[str, float]]:
        """Poll the task every 50 ms until it is ready: each state it showed, in order, with the
        monotonic time it was first seen."""
        seen: list[tuple[str, float]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.task(task_id)
            if info is not None and (not seen or seen[-1][0] != info["state"]):
                seen.append((info["state"], time.monotonic()))
            if seen and seen[-1][0] in ("SUCCESS", "FAILURE"):
                return seen
            time.sleep(POLL_S)
        raise AssertionError(f"Flower never showed {task_id} ready; seen {seen}\n{self.log()}")

    def event_count(self, event_type: str, task_name: str = RACE) -> float:
        """How many ``event_type`` events of ``task_name`` tasks Flower has processed."""
        text = self.http.get("/metrics").raise_for_status().text
        total = 0.0
        for line in text.splitlines():
            if line.startswith("flower_events_total{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
                if labels.get("type") == event_type and labels.get("task") == task_name:
                    total += float(line.rsplit(" ", 1)[1])
        return total


def start_flower(rc: RaceCluster, tmp: Path) -> Flower:
    """``celery -A gpuhedge_celery flower`` on a free loopback port, with the workers' env."""
    port = free_port()
    log_path = tmp / "flower.log"
    argv = [sys.executable, "-m", "celery", "-A", "gpuhedge_celery", "flower",
            f"--port={port}", "--address=127.0.0.1"]  # fmt: skip
    env = {**rc.cluster.env, "FLOWER_UNAUTHENTICATED_API": "true"}  # Flower 2 locks its API
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            argv, env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=str(tmp),
            start_new_session=True,
        )  # fmt: skip
    return Flower(
        rc, process, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5), log_path
    )


def stop_flower(flower: Flower) -> None:
    flower.http.close()
    try:
        os.killpg(flower.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        flower.process.wait(10)
    except subprocess.TimeoutExpired:
        pass


def wait_until_listening(flower: Flower, timeout_s: float = 30) -> None:
    """Flower answers HTTP, and its event receiver is subscribed: it sees a quick race."""

    def answers() -> bool:
        if flower.process.poll() is not None:
            raise AssertionError(f"Flower exited with {flower.process.returncode}:\n{flower.log()}")
        try:
            return flower.http.get("/healthcheck").status_code == 200
        except httpx.TransportError:
            return False

    wait_for(answers, timeout_s, f"Flower to answer HTTP\n{flower.log()}", every_s=0.1)
    # events sent before Flower subscribed are lost (pub/sub): race until one is seen
    deadline = time.monotonic() + timeout_s
    while True:
        race_id = flower.rc.send({"sim": {"p": {"queue_s": 0, "run_s": 0}}}).get(timeout=20)[
            "race_id"
        ]
        try:
            wait_for(
                lambda race_id=race_id: flower.task(race_id),
                2,
                "Flower to see a warm-up race",
                every_s=POLL_S,
            )
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise AssertionError(f"Flower saw no race events\n{flower.log()}") from None


@pytest.fixture(scope="module")
def flower(redis_url, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flower_real")
    config = tmp / "flower-real.yaml"
    # the slow hedge runs 250 provider seconds: raise the 180 s attempt cap out of its way
    config.write_text(RACE_CONFIG.replace("attempt_cap_s: 180", "attempt_cap_s: 1000", 1))
    rc = start_race_cluster(
        redis_url, tmp, workers=1, CELERY_WORKER_TASK_EVENTS="1", GPUHEDGE_CONFIG=str(config)
    )
    running = None
    try:
        assert "task events: ON" in rc.cluster.workers[0].log()  # the worker really runs with -E
        running = start_flower(rc, tmp)
        wait_until_listening(running)
        yield running
    finally:
        if running is not None:
            stop_flower(running)
        stop_race_cluster(rc)


def test_flower_shows_a_hedge_race_in_custom_states_then_success(flower):
    res = flower.rc.send(SLOW_HEDGE, policy=SLOW_HEDGE_POLICY)
    try:
        seen = flower.watch(res.id)
        assert res.get(timeout=20)["winner"] == "h"
    except Exception:
        print(flower.rc.logs(), flower.log(), sep="\n")
        raise
    states = [state for state, _ in seen]
    assert states[-1] == "SUCCESS", states
    assert "QUEUED" in states and "RUNNING" in states, states
    # the hedge runs 1.5 s just before the win; WON only lasts until the result is marked
    assert [s for s in states if s != "WON"][-2] == "RUNNING", states
    custom_at = next(t for state, t in seen if state in CUSTOM)
    assert seen[-1][1] - custom_at >= 1.0, seen  # the hedge's ~2.5 s, in custom states
    info = flower.task(res.id)
    assert info["uuid"] == res.id and info["name"] == RACE  # from the race's own task-received
    assert "'winner': 'h'" in info["result"]  # the short result the race's task-succeeded carries
    # Flower's API gives Celery's task fields only, not the race events' custom ones
    assert "provider" not in info and "race_id" not in info, sorted(info)


def test_flower_names_the_worker_that_ran_the_race(flower):
    """Race events are sent as the worker's node name, not a generated ``gen<pid>@<host>``."""
    res = flower.rc.send({"sim": {"p": {"queue_s": 0, "run_s": 1}}})
    res.get(timeout=20)
    info = wait_for(lambda: flower.task(res.id), 10, "Flower to know the race")
    assert info["worker"] == flower.rc.cluster.workers[0].nodename, info["worker"]


def test_events_after_success_do_not_replace_it_in_flower(flower):
    """The loser's LOSER_CANCELLED comes after SUCCESS; Flower keeps showing SUCCESS."""
    before = flower.event_count("task-loser_cancelled")
    res = flower.rc.send(SLOW_HEDGE, policy=SLOW_HEDGE_POLICY)
    assert res.get(timeout=20)["winner"] == "h"
    receipt = flower.rc.receipt(res.id)  # every attempt settled: the primary's cancel confirmed
    assert next(a for a in receipt["attempts"] if a["provider"] == "p")["phase"] == "cancelled"
    wait_for(
        lambda: flower.event_count("task-loser_cancelled") > before,
        10,
        "Flower to process the race's task-loser_cancelled event",
        every_s=POLL_S,
    )
    info = flower.task(res.id)
    assert info["state"] == "SUCCESS", info
    listed = flower.http.get("/api/tasks", params={"taskname": RACE}).raise_for_status().json()
    assert listed[res.id]["state"] == "SUCCESS", listed[res.id]
    assert listed[res.id]["name"] == RACE


def test_flower_shows_a_race_with_nothing_valid_as_failure(flower):
    res = flower.rc.send(NOTHING_VALID)
    seen = [state for state, _ in flower.watch(res.id)]
    with pytest.raises(RaceFailed):
        res.get(timeout=20)
    assert seen[-1] == "FAILURE" and "SUCCESS" not in seen, seen
    assert "QUEUED" in seen or "RUNNING" in seen, seen  # each attempt runs 0.3 s before failing
    info = flower.task(res.id)
    assert info["name"] == RACE
    assert "no attempt returned a valid result" in (info["exception"] or ""), info
