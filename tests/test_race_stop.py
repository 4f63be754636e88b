"""Stopping a race on real workers: the CLI, the Python call and Celery's own ``revoke()``.

Two real coordination workers race sim providers on compressed time (a provider second is
10 ms) with a budget on, so every attempt reserves before its submit. Each race's primary runs
far longer than the test (10,000 provider s, capped at 3,000: 30 s real), so only the stop ends
it. What every stop must leave: the caller's ``.get()`` raising at once with an explicit
failure, no hedge launched after the stop, every sim job stopped (the sim's own ground truth),
each attempt's cancel receipt, the receipt naming who stopped the race and when, and every
budget reservation settled.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest
from celery.exceptions import TaskRevokedError
from click.testing import CliRunner

from gpuhedge_celery.cli import cli
from gpuhedge_celery.errors import ConfigError, RaceFailed
from gpuhedge_celery.store.budget import BudgetStore
from gpuhedge_celery.tasks.result import RaceResult
from tests.support.fixtures_celery import broker_url_for
from tests.support.fixtures_races import start_race_cluster, stop_race_cluster
from tests.support.race_configs import race_config, sim_pair
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.timeout(180), pytest.mark.cluster]

CONFIG = race_config(
    sim_pair(p_fast=(0, 4), h_fast=(0, 5), cancel=(0.28, 0.35)),
    "fixed",
    {"hedge_after_ms": 30000},
    time_scale=0.01,
    timeouts={"attempt_cap_s": 3000},
    budget={"max_usd_per_request": 50},
)
SLOW = {"sim": {"p": {"queue_s": 0, "run_s": 10000}, "h": {"queue_s": 0, "run_s": 10000}}}
LATE_HEDGE = "hedge:p->h@200s"  # 2 s real after the primary's submit: the stop comes first
EARLY_HEDGE = "hedge:p->h@10s"  # 0.1 s real: both jobs run when the stop comes


@pytest.fixture(scope="module")
def stop_cluster(redis_url, tmp_path_factory, broker, request):
    rc = start_race_cluster(redis_url, tmp_path_factory.mktemp("stop"), config=CONFIG,
                            broker_url=broker_url_for(broker, request))  # fmt: skip
    rc.budget = BudgetStore(rc.client, rc.prefix)
    yield rc
    stop_race_cluster(rc)


def attempts(rc, race_id):
    record = rc.store.load(race_id)
    return [] if record is None else record.state["race"]["attempts"]


def wait_running(rc, race_id, count):
    """Until ``count`` attempts were submitted (their jobs run at the sim)."""
    wait_for(
        lambda: sum(1 for a in attempts(rc, race_id) if a["phase"] == "running") == count,
        30, f"{count} running job(s) in race {race_id}",
    )  # fmt: skip


def cli_env(rc):
    env = {"GPUHEDGE_BROKER_PREFIX": f"{rc.prefix}:"}  # the workers' broker keys
    if rc.cluster.broker_url is not None:  # the plain Redis beside a Redis Cluster store
        env["GPUHEDGE_BROKER_URL"] = rc.cluster.broker_url
    return env


def invoke(rc, *args):
    base = ["--redis-url", rc.redis_url, "--prefix", rc.prefix]
    return CliRunner().invoke(cli, [*base, *args], env=cli_env(rc))


def check_stopped(rc, race_id, by, launched):
    """The final receipt of a race stopped by ``by`` with ``launched`` attempts."""
    receipt = rc.receipt(race_id)
    assert receipt["stopped_by"] == by and receipt["stopped_at"] >= receipt["created_at"]
    assert receipt["failure_reason"] == "stopped" and receipt["winner"] is None
    assert receipt["note"] == f"stopped by {by}"
    assert [a["role"] for a in receipt["attempts"]] == launched
    for a in receipt["attempts"]:
        assert any(label == "cancel_sent (stopped)" for _, label in a["timeline"]), a
        cancel = a["cancel_receipt"]
        assert cancel["confirmed_terminal"] and not cancel["leaked"], cancel
        assert cancel["terminal_status"] == "CANCELLED"
        record = rc.budget.reservation(race_id, a["id"])  # settled as any cancelled attempt
        assert record is not None and record.get("settled") is not None, record
    assert rc.running_sim_jobs(receipt) == []  # the sim's own truth: no job still runs
    return receipt


def test_the_cli_stops_a_race_before_its_hedge_and_says_so(stop_cluster):
    rc = stop_cluster
    res = rc.send(SLOW, policy=LATE_HEDGE)
    wait_running(rc, res.id, 1)
    out = invoke(rc, "cancel", res.id[:12])  # a prefix, as `watch` prints it
    assert out.exit_code == 0, out.output
    assert f"race {res.id} stopped by cli" in out.output and "a1 p (primary)" in out.output
    started = time.monotonic()
    with pytest.raises(RaceFailed) as caught:
        res.get(timeout=20)
    assert time.monotonic() - started < 5  # explicit and at once, not at a deadline
    assert caught.value.reason == "stopped" and "stopped by cli" in str(caught.value)
    check_stopped(rc, res.id, "cli", ["primary"])
    time.sleep(2.5)  # past the hedge's due time: it never launches
    assert [a["role"] for a in rc.receipt(res.id)["attempts"]] == ["primary"]
    assert rc.budget.reservation(res.id, "a2") is None  # nothing was reserved for it
    shown = invoke(rc, "receipt", res.id)
    assert shown.exit_code == 0 and "stopped   " in shown.output and " by cli" in shown.output
    again = invoke(rc, "cancel", res.id, "--json")  # a second stop is the first one
    assert again.exit_code == 0, again.output
    answer = json.loads(again.output)
    assert answer["outcome"] == "already_stopped" and answer["stopped_by"] == "cli"


def test_the_python_call_stops_both_running_jobs(stop_cluster):
    import gpuhedge_celery

    rc = stop_cluster
    res = rc.send(SLOW, policy=EARLY_HEDGE)
    wait_running(rc, res.id, 2)
    answer = gpuhedge_celery.cancel_race(
        res.id, by="nightly-batch", redis_url=rc.redis_url, prefix=rc.prefix, app=rc.app
    )
    assert answer.outcome == "stopped" and answer.ok and answer.stopped_by == "nightly-batch"
    assert [c["attempt"] for c in answer.cancelling] == ["a1", "a2"]
    with pytest.raises(RaceFailed) as caught:
        res.get(timeout=20)
    assert caught.value.reason == "stopped" and "stopped by nightly-batch" in str(caught.value)
    receipt = check_stopped(rc, res.id, "nightly-batch", ["primary", "hedge"])
    assert caught.value.receipt["stopped_by"] == "nightly-batch"
    assert receipt["stopped_at"] == pytest.approx(answer.stopped_at)
    # the result object's own stop: idempotent on a stopped race
    assert RaceResult(res.id, app=rc.app).stop(by="other").outcome == "already_stopped"


def test_revoke_stops_the_race(stop_cluster):
    rc = stop_cluster
    res = rc.send(SLOW, policy=LATE_HEDGE)
    wait_running(rc, res.id, 1)
    res.revoke()
    with pytest.raises(TaskRevokedError):
        res.get(timeout=20)
    wait_for(lambda: rc.store.receipt(res.id), 20, "the revoked race's receipt")
    check_stopped(rc, res.id, "revoke", ["primary"])
    time.sleep(2.5)  # past the hedge's due time: it never launches
    assert [a["role"] for a in rc.receipt(res.id)["attempts"]] == ["primary"]
    # the caller keeps Celery's own answer: the race's failure did not overwrite it
    assert rc.app.backend.get_task_meta(res.id, cache=False)["status"] == "REVOKED"


def test_a_stop_of_a_won_or_unknown_race_does_nothing_and_says_why(stop_cluster):
    import gpuhedge_celery

    rc = stop_cluster
    res = rc.send({"sim": {"p": {"queue_s": 0, "run_s": 1}}})
    assert res.get(timeout=20)["winner"] == "p"
    rc.receipt(res.id)
    out = invoke(rc, "cancel", res.id)
    assert out.exit_code == 1 and "had already finished (won by p): nothing to stop" in out.output
    answer = gpuhedge_celery.cancel_race(res.id, redis_url=rc.redis_url, prefix=rc.prefix,
                                         app=rc.app)  # fmt: skip
    assert answer.outcome == "already_finished" and not answer.ok and answer.winner == "p"
    assert rc.receipt(res.id)["stopped_by"] is None

    unknown = gpuhedge_celery.cancel_race("no-such-race", redis_url=rc.redis_url,
                                          prefix=rc.prefix, app=rc.app)  # fmt: skip
    assert unknown.outcome == "unknown" and not unknown.ok


def test_the_cancel_cli_errors_are_one_line_with_exit_codes(stop_cluster):
    script = shutil.which("gpuhedge-celery")
    assert script, "the gpuhedge-celery entry point is not installed"
    env_args = ["--redis-url", stop_cluster.redis_url, "--prefix", stop_cluster.prefix]
    cases = [
        (env_args + ["cancel", "no-such-race"], 1, "no race 'no-such-race'"),
        (env_args + ["cancel", "bad id"], 2, "invalid race id"),
        (env_args + ["cancel", "x", "--by", " "], 2, "by: expected a non-empty string"),
        (["--redis-url", "redis://127.0.0.1:1/0", "cancel", "x"], 3, "unreachable"),
    ]
    for argv, code, fragment in cases:
        done = subprocess.run([script, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == code, done.stderr
        assert fragment in done.stderr and done.stderr.count("\n") == 1 and not done.stdout


def test_revoke_while_the_primary_is_being_submitted_stops_the_race(stop_cluster):
    rc = stop_cluster
    # the primary's submit takes 2 s real, in hedged_infer's own thread: the task is still
    # running when the revoke comes, so its worker leaves the result alone (Celery's rule)
    slow_submit = {"sim": {"p": {"queue_s": 0, "run_s": 10000, "submit_s": 200}}}
    res = rc.send(slow_submit, policy=LATE_HEDGE)
    wait_for(lambda: [a["phase"] for a in attempts(rc, res.id)] == ["launching"], 20,
             "the primary's submit under way")  # fmt: skip
    res.revoke()
    with pytest.raises((RaceFailed, TaskRevokedError)):  # per worker: see revokes.py
        res.get(timeout=20)
    wait_for(lambda: rc.store.receipt(res.id), 20, "the revoked race's receipt")
    check_stopped(rc, res.id, "revoke", ["primary"])  # its job was cancelled once it existed


def test_the_result_objects_stop_revokes_a_race_not_started_yet(stop_cluster):
    rc = stop_cluster
    # due in 2 s: the worker holds the message, and no race exists until then
    sent = rc.app.send_task("gpuhedge.hedged_infer", (SLOW,), {"policy": LATE_HEDGE},
                            queue="gpuhedge.coord", countdown=2)  # fmt: skip
    answer = RaceResult(sent.id, app=rc.app).stop(by="caller")
    assert answer.outcome == "revoked" and answer.ok
    with pytest.raises(TaskRevokedError):
        sent.get(timeout=20)
    time.sleep(2.5)  # past its due time: the revoked message never ran, no race was made
    assert rc.store.load(sent.id) is None and rc.store.receipt(sent.id) is None


def test_a_hand_made_race_step_cannot_report_a_result(stop_cluster):
    """Only a stop enters a race by message: a forged ResultArrived (what made a race "win"
    with no payload) is refused with one line, and the race is as it was."""
    import gpuhedge_celery
    from gpuhedge_celery.core.race_events import ResultArrived

    rc = stop_cluster
    res = rc.send(SLOW, policy=LATE_HEDGE)
    wait_running(rc, res.id, 1)
    version = rc.store.load(res.id).version
    forged = ResultArrived("a1").to_dict()
    step = rc.app.send_task("gpuhedge.race_step", (res.id, forged), queue="gpuhedge.coord")
    with pytest.raises(ConfigError, match="race_step takes only stop_requested"):
        step.get(timeout=20)
    record = rc.store.load(res.id)
    assert record.version == version and record.state["race"]["winner"] is None
    answer = gpuhedge_celery.cancel_race(  # leave nothing running for the next test
        res.id, by="test", redis_url=rc.redis_url, prefix=rc.prefix, app=rc.app
    )
    assert answer.ok
