"""``gpuhedge-celery webhooks --workers 2``: two receiver processes on one port.

The real command runs (a supervisor and two receivers, each with its own race runtime and Redis
clients) against the real Redis and the RunPod fake (its own process). Races are created by a
driver in this process with webhooks on, as a coordination worker would create them. Checks:
deliveries are answered by both processes (``x-gpuhedge-receiver``: the answering pid), a
delivery and its retry sent at once, to whichever processes the kernel picks, still make one
event, the fake's own deliveries complete their races, a receiver that dies is replaced, and a
``SIGTERM`` stops them all and frees the port.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gpuhedge_celery.config import parse_config_text
from gpuhedge_celery.providers.ratelimit import LocalLimiter
from gpuhedge_celery.race.base import RaceParts
from gpuhedge_celery.race.driver import RaceDriver
from gpuhedge_celery.race.settings import RaceSettings
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.webhooks import token as tokens
from gpuhedge_celery.webhooks.settings import WebhookSettings
from tests.support.runpod_fake import KEY, FakeRunpod, default_config
from tests.support.webhook_server import free_port
from tests.test_races_driver import Recorder, race_stores
from tests.test_webhooks_receiver import CONFIG, request, wait_for

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[1]
SECRET = "two-receivers-secret-0123456789"
HEADER = "x-gpuhedge-receiver"


@pytest.fixture(scope="module")
def runpod_fake():
    with FakeRunpod({"api_key": KEY, "webhook_gap_s": 0.2}) as fake:
        yield fake


class Receivers:
    """The supervisor process (``proc``) of ``webhooks --workers 2`` on ``port``."""

    def __init__(self, env: dict[str, str], tmp: Path, *options: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "receiver.log"
        argv = [sys.executable, "-m", "gpuhedge_celery", *options, "webhooks", "--workers", "2",
                "--port", str(self.port)]  # fmt: skip
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=str(tmp), start_new_session=True)  # fmt: skip
        if not wait_for(self.healthy, 60):
            self.proc.kill()
            raise RuntimeError(self.log.read_text())

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def pids(self, n: int = 40) -> set[int]:
        """The receiver pids that answered ``n`` health checks, each on a new connection."""
        return {int(httpx.get(f"{self.url}/healthz").headers[HEADER]) for _ in range(n)}

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            return None


def receiver_env(config: Path, redis_url: str, prefix: str) -> dict[str, str]:
    env = {**os.environ, "GPUHEDGE_REDIS_URL": redis_url, "GPUHEDGE_PREFIX": prefix,
           "GPUHEDGE_BROKER_PREFIX": f"{prefix}:", "GPUHEDGE_CONFIG": str(config),
           "GPUHEDGE_WEBHOOK_SECRET": SECRET, "RUNPOD_TEST_KEY": KEY,
           "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    for name in ("GPUHEDGE_BROKER_URL", "GPUHEDGE_WEBHOOK_URL", "GPUHEDGE_GPU"):
        env.pop(name, None)
    return env


@pytest.fixture
def two(runpod_fake, redis_url, redis_client, prefix, tmp_path):
    """The receivers (``.receivers``) and a driver whose jobs' webhooks go to them."""
    runpod_fake.reset()
    config = tmp_path / "wh.yaml"
    config.write_text(CONFIG.format(base=runpod_fake.base_url))
    env = receiver_env(config, redis_url, prefix)
    receivers = Receivers(env, tmp_path)
    cfg = parse_config_text(config.read_text())
    providers = {"rp": cfg.build("rp", env={"RUNPOD_TEST_KEY": KEY}, limiter=LocalLimiter())}
    hooks = WebhookSettings(f"{receivers.url}/hooks", SECRET, fallback_s=30.0)
    store, timers = race_stores(redis_client, prefix)
    driver = RaceDriver(RaceParts(store, timers, providers.__getitem__, Recorder(), RaceSettings(),
                        webhooks=hooks))  # fmt: skip
    driver.cfg, driver.fake, driver.receivers = cfg, runpod_fake, receivers
    yield driver
    receivers.stop()


def completed(d, race_id):
    """RunPod's ``/status`` body of the race's finished job: what its webhook carries."""
    job_id = d.store.load(race_id).state["race"]["attempts"][0]["job_id"]
    return {"id": job_id, "status": "COMPLETED", "delayTime": 10, "executionTime": 120,
            "output": default_config()["output"]}  # fmt: skip


def ends(receipt):
    """The first attempt's end events (its timeline entries that say how it ended)."""
    a1 = next(a for a in receipt["attempts"] if a["id"] == "a1")
    return [label for _, label in a1["timeline"] if label.startswith("COMPLETED")]


def test_deliveries_are_answered_by_both_processes_and_a_retry_is_no_second_event(two):
    d = two
    n = 30
    spec = build_spec(d.cfg)
    d.fake.configure(faults={"webhook": {"drop_rate": 1.0}})  # this test posts the deliveries
    try:
        for i in range(n):
            d.create(f"m{i}", request(run_s=0.3), spec, submit_first=True)
        jobs = [d.store.load(f"m{i}").state["race"]["attempts"][0]["job_id"] for i in range(n)]
        assert wait_for(lambda: all(d.fake.job("wh", j)["status"] == "COMPLETED" for j in jobs))
    finally:
        d.fake.configure(faults={"webhook": {"drop_rate": 0.0}})
    posts = []
    for i in range(n):
        target = f"{d.receivers.url}/hooks/m{i}/a1/{tokens.token(SECRET, f'm{i}', 'a1')}"
        posts += [(f"m{i}", target, completed(d, f"m{i}"))] * 2  # the delivery and its retry

    def post(item):
        race_id, target, body = item
        r = httpx.post(target, json=body, timeout=30)  # a new connection each
        return race_id, r.status_code, r.json(), int(r.headers[HEADER])

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(post, posts))
    assert {code for _, code, _, _ in answers} == {200}, answers
    pids = {pid for *_, pid in answers}
    assert len(pids) == 2 and d.receivers.proc.pid not in pids  # both receivers took some
    for i in range(n):
        mine = [a for race, _, a, _ in answers if race == f"m{i}"]
        assert any(a.get("applied") == "COMPLETED" for a in mine), mine
        receipt = d.store.receipt(f"m{i}")
        assert receipt is not None and receipt["winner"] == "a1"
        assert ends(receipt) == ["COMPLETED (valid)"], receipt  # one event, not two
    # no poll: each delivery woke its race and a /status read verified it (a retry landing on
    # the process that read it already is answered from that answer)
    assert n <= d.fake.route("wh", "status")["requests"] <= 2 * n


def test_the_fakes_own_deliveries_complete_every_race_through_two_receivers(two):
    d = two
    n = 24
    spec = build_spec(d.cfg)
    for i in range(n):
        d.create(f"f{i}", request(run_s=0.2), spec, submit_first=True)
    assert wait_for(lambda: all(d.store.receipt(f"f{i}") for i in range(n)), 60)
    for i in range(n):
        receipt = d.store.receipt(f"f{i}")
        assert receipt["winner"] == "a1" and ends(receipt) == ["COMPLETED (valid)"]
    # The receiver applies a delivery before it answers, and the fake counts the delivery once
    # the answer is in: a receipt can be there a moment before its delivery is counted.
    assert wait_for(lambda: d.fake.stats()["webhooks"]["sent"] >= n, 10)
    hooks = d.fake.stats()["webhooks"]
    assert hooks["sent"] == n and hooks["codes"] == {"200": n}, hooks
    assert d.fake.route("wh", "status")["requests"] == n  # one verifying read per delivery


def test_a_dead_receiver_is_replaced_and_sigterm_stops_all_and_frees_the_port(two):
    receivers = two.receivers
    first = receivers.pids()
    assert len(first) == 2
    victim = min(first)
    os.kill(victim, signal.SIGKILL)
    # the survivor serves meanwhile; a new process joins it within a few seconds
    assert wait_for(lambda: len(receivers.pids(20) - {victim}) == 2, 30)
    assert receivers.stop() == 0
    for pid in first - {victim}:
        assert wait_for(lambda pid=pid: not _alive(pid), 10)
    with socket.socket() as s:  # nobody listens any more
        assert s.connect_ex(("127.0.0.1", receivers.port)) != 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_port_already_taken_stops_the_command_with_one_line_per_process(tmp_path, redis_url):
    env = {**os.environ, "GPUHEDGE_REDIS_URL": redis_url, "GPUHEDGE_WEBHOOK_SECRET": SECRET,
           "PYTHONPATH": str(REPO)}  # fmt: skip
    env.pop("GPUHEDGE_CONFIG", None)
    with socket.socket() as taken:  # bound without SO_REUSEPORT: nobody may share it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "gpuhedge_celery", "webhooks", "--workers", "2",
                "--port", str(port)]  # fmt: skip
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1, done.stderr
    said = done.stderr.strip().splitlines()
    assert any(f"cannot listen on 127.0.0.1:{port}" in line for line in said), said
    assert "did not start" in said[-1] and "Traceback" not in done.stderr


def test_each_receiver_process_logs_at_the_commands_log_level(
    runpod_fake, redis_url, prefix, tmp_path
):
    import re

    config = tmp_path / "wh.yaml"
    config.write_text(CONFIG.format(base=runpod_fake.base_url))
    receivers = Receivers(receiver_env(config, redis_url, prefix), tmp_path, "--log-level", "INFO")
    try:
        answering = receivers.pids()
        logged = {
            int(p)
            for p in re.findall(
                r"INFO \S+: receiver process (\d+) serving", receivers.log.read_text()
            )
        }
        # a spawned receiver inherits no logging set-up: the command hands its level down
        assert len(logged) == 2 and answering <= logged, (answering, receivers.log.read_text())
    finally:
        receivers.stop()
