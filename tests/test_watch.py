"""``gpuhedge-celery watch`` against live races on a real worker (``--once``, JSON and text)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from gpuhedge_celery.cli import cli
from tests.support.fixtures_races import start_race_cluster, stop_race_cluster
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)

# the primary runs ~1.5 s, the hedge (launched at 300 ms) ~1.2 s: both are in flight for a while
SLOW = {"sim": {"p": {"queue_s": 0, "run_s": 150}, "h": {"queue_s": 0, "run_s": 120}}}


@pytest.fixture(scope="module")
def watch_cluster(redis_url, tmp_path_factory):
    rc = start_race_cluster(redis_url, tmp_path_factory.mktemp("watch"), workers=1)
    yield rc
    stop_race_cluster(rc)


def watch(rc, *args):
    env = {"GPUHEDGE_REDIS_URL": rc.redis_url, "GPUHEDGE_PREFIX": rc.prefix}
    result = CliRunner().invoke(cli, ["watch", *args], env=env, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_watch_once_shows_races_in_flight_then_forgets_them(watch_cluster):
    rc = watch_cluster
    res = rc.send(SLOW)

    def both_running():
        snap = json.loads(watch(rc, "--once", "--json"))
        row = next((r for r in snap["races"] if r["race_id"] == res.id), None)
        if row and [a["phase"] for a in row["attempts"]] == ["running", "running"]:
            return snap, row
        return None

    snap, row = wait_for(both_running, 20, "two running attempts in the watch output")
    assert snap["prefix"] == rc.prefix and snap["counts"].get("racing", 0) >= 1
    assert row["status"] == "racing" and row["winner"] is None and row["leaks"] == []
    assert [(a["provider"], a["role"]) for a in row["attempts"]] == [("p", "primary"),
                                                                     ("h", "hedge")]  # fmt: skip
    assert all(a["live_job"] and a["job_id"].startswith("sim-") for a in row["attempts"])
    assert row["age_ms"] > 0 and row["heartbeat_ms_ago"] >= 0

    text = watch(rc, "--once")
    line = next(x for x in text.splitlines() if x.startswith(res.id[:12]))
    assert "racing" in line and "p:running/" in line and "h:running/" in line
    assert text.splitlines()[1].split()[:3] == ["RACE", "STATUS", "POLICY"]

    # the installed entry point, as a script would run it
    script = shutil.which("gpuhedge-celery")
    assert script, "gpuhedge-celery is not installed (pip install -e .)"
    done = subprocess.run(
        [script, "--redis-url", rc.redis_url, "watch", "--once", "--json"],
        capture_output=True, text=True, timeout=60, env={"GPUHEDGE_PREFIX": rc.prefix,
                                                         "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["prefix"] == rc.prefix

    result = res.get(timeout=20)
    rc.receipt(res.id)
    after = json.loads(watch(rc, "--once", "--json"))
    assert res.id not in [r["race_id"] for r in after["races"]]  # finished, nothing to watch
    finished = json.loads(watch(rc, "--once", "--json", "--all"))
    row = next((r for r in finished["races"] if r["race_id"] == res.id), None)
    if row is not None:  # it may already have left the heartbeat index
        assert row["status"] == "finished" and row["winner"] == result["winner"]


def test_watch_timers_column_and_bad_options(watch_cluster):
    rc = watch_cluster
    res = rc.send({"sim": {"p": {"queue_s": 0, "run_s": 100}}}, policy="hedge:p->h@5s")

    def armed():
        snap = json.loads(watch(rc, "--once", "--json"))
        row = next((r for r in snap["races"] if r["race_id"] == res.id), None)
        return row if row and "hedge" in row["timers"] else None

    row = wait_for(armed, 20, "the hedge timer in the watch output")
    assert 0 < row["timers"]["hedge"] <= 5100  # due about 5 s after the primary's submit
    assert "hedge@+" in watch(rc, "--once")
    res.get(timeout=20)
    bad = CliRunner().invoke(cli, ["watch", "--interval", "0"])
    assert bad.exit_code == 2 and "--interval" in bad.output


def test_rows_and_table_for_leaks_and_expired_races():
    """Pure: a leaked attempt is flagged, a race whose state expired still shows its live jobs."""
    from gpuhedge_celery.commands.watch import _row, render

    state = {
        "race": {
            "policy": {"kind": "hedge"},
            "started_at": 100.0,
            "attempts": [
                {
                    "id": "a1",
                    "provider": "p",
                    "role": "primary",
                    "phase": "leaked",
                    "last_state": "IN_PROGRESS",
                    "job_id": "j1",
                    "receipt": {"evidence": "provider_ack", "leaked": True},
                },
                {
                    "id": "a2",
                    "provider": "h",
                    "role": "hedge",
                    "phase": "ended",
                    "last_state": "COMPLETED",
                    "job_id": "j2",
                    "receipt": None,
                },
            ],  # fmt: skip
            "timers": {},
            "winner": "a2",
            "finished": True,
            "flags": ["leaked"],
        }
    }
    row = _row("race-1", 101_000, state, {"a1": {}}, 102.0, True)
    assert row["status"] == "finished" and row["winner"] == "h" and row["leaks"] == ["a1"]
    assert (
        row["attempts"][0]["live_job"] and row["attempts"][0]["cancel_evidence"] == "provider_ack"
    )
    assert row["age_ms"] == 2000.0 and row["heartbeat_ms_ago"] == 1000
    gone = _row("race-2", 0, None, {"a1": {}}, 102.0, False)
    assert gone == {"race_id": "race-2", "status": "expired", "live_jobs": ["a1"]}
    snap = {"at": 102.0, "prefix": "x", "races": [row, gone], "counts": {"finished": 1}}
    text = render(snap)
    assert "p:leaked/IN_PROGRESS LEAK" in text and "race-2" in text and "expired" in text
    assert "(no race in flight)" in render({**snap, "races": [], "counts": {}})
