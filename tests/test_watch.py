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

pytestmark = [pytest.mark.timeout(120), pytest.mark.cluster]

# the primary runs ~1.5 s, the hedge (launched at 300 ms) ~1.2 s: both are in flight for a while
SLOW = {"sim": {"p": {"queue_s": 0, "run_s": 150}, "h": {"queue_s": 0, "run_s": 120}}}


@pytest.fixture(scope="module")
def watch_cluster(redis_url, tmp_path_factory, broker, request):
    from tests.support.fixtures_celery import broker_url_for

    rc = start_race_cluster(redis_url, tmp_path_factory.mktemp("watch"), workers=1,
                            broker_url=broker_url_for(broker, request))  # fmt: skip
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
    assert_columns_line_up(text)

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
    assert row is not None, "--all lists recently finished races"
    assert row["status"] == "finished" and row["winner"] == result["winner"]


def assert_columns_line_up(text):
    """Every cell starts under its header, whatever the row holds."""
    lines = text.splitlines()
    header, rows = lines[1], [x for x in lines[2:] if " expired " not in x]
    assert rows, text
    starts = [header.index(name) for name in header.split()]
    for row in rows:
        for start in starts[1:]:
            assert row[start - 1] == " " and row[start] != " ", (text, start)


def test_watch_all_lists_finished_races_and_receipt_takes_the_short_id(watch_cluster):
    rc = watch_cluster
    fast = {"sim": {"p": {"queue_s": 0, "run_s": 1}}}
    # a busy race (two attempts, two timers) beside finished ones: the columns still line up
    busy = rc.send({"sim": {"p": {"queue_s": 0, "run_s": 100}, "h": {"queue_s": 0,
                   "run_s": 100}}}, policy="cascade:p->h->f@q0.02s+s0.05s+e5s")  # fmt: skip
    done = [rc.send(fast) for _ in range(3)]
    for res in done:
        res.get(timeout=20)
        rc.receipt(res.id)

    def shown():
        text = watch(rc, "--once", "--all")
        return text if busy.id[:12] in text and "h:running" in text else None

    text = wait_for(shown, 20, "the busy race with both attempts running")
    for res in done:
        line = next(x for x in text.splitlines() if x.startswith(res.id[:12]))
        assert "finished" in line and " p " in f" {line} "
    assert_columns_line_up(text)
    assert len(json.loads(watch(rc, "--once", "--json", "--all"))["races"]) >= 4

    # the short id watch prints is enough for receipt
    env = {"GPUHEDGE_REDIS_URL": rc.redis_url, "GPUHEDGE_PREFIX": rc.prefix}
    out = CliRunner().invoke(cli, ["receipt", done[0].id[:12], "--json"], env=env)
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == rc.store.receipt(done[0].id)
    busy.get(timeout=30)


def test_receipt_by_prefix_says_when_a_prefix_is_ambiguous_or_unknown(watch_cluster, capsys):
    import uuid

    from gpuhedge_celery.cli import main

    rc = watch_cluster
    base = uuid.uuid4().hex[:16]
    ids = [f"{base}-{i}-race" for i in range(3)]
    for race_id in ids:
        rc.app.send_task(
            "gpuhedge.hedged_infer", ({"sim": {"p": {"queue_s": 0, "run_s": 1}}},),
            task_id=race_id, queue="gpuhedge.coord",
        ).get(timeout=20)  # fmt: skip
        rc.receipt(race_id)

    def receipt(arg):
        """The console script's exit code, stdout and stderr (one-line errors, exit codes)."""
        code = main(["--redis-url", rc.redis_url, "--prefix", rc.prefix, "receipt", arg, "--json"])
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, _ = receipt(f"{base}-1")  # a prefix naming one race
    assert code == 0 and json.loads(out)["race_id"] == ids[1]
    code, out, err = receipt(base)
    assert (code, out, err.count("\n")) == (1, "", 1)
    assert f"race id prefix '{base}' matches 3 races ({', '.join(ids)})" in err
    assert "give more characters" in err
    code, out, err = receipt("zz" + base)
    assert code == 1 and "no race 'zz" in err and "no race id starts with it" in err
    # found by the SCAN fallback once the index no longer lists it
    rc.client.zrem(rc.store.shards.index_of(ids[2]).finished, ids[2])
    code, out, _ = receipt(f"{base}-2")
    assert code == 0 and json.loads(out)["race_id"] == ids[2]
    code, out, err = receipt(base[:14] + "-x")  # nothing starts with it: the SCAN finds none
    assert code == 1 and "no race" in err


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


def test_a_cancel_still_waiting_shows_how_long_it_has_waited():
    """Pure: a loser whose cancel was decided 4.5 s ago and is not answered yet (waiting for
    the fleet's /cancel token) shows the wait; an answered one shows the token wait it had."""
    from gpuhedge_celery.commands.watch import _row, render

    def attempt(aid, phase, sent_at, receipt):
        return {"id": aid, "provider": aid, "role": "primary", "phase": phase,
                "last_state": "QUEUED", "job_id": f"j-{aid}", "cancel_sent_at": sent_at,
                "receipt": receipt}  # fmt: skip

    state = {
        "race": {
            "policy": {"kind": "cutover"},
            "started_at": 100.0,
            "attempts": [
                attempt("p", "cancelling", 1.0, {"evidence": "no_evidence"}),
                attempt(
                    "q",
                    "cancelled",
                    1.0,
                    {"evidence": "confirmed_terminal", "token_wait_ms": 3100.0},
                ),  # fmt: skip
            ],
            "timers": {},
            "winner": None,
            "finished": False,
        }
    }
    row = _row("race-1", 105_000, state, {}, 105.5, False)
    p, q = row["attempts"]
    assert p["cancel_pending_ms"] == 4500.0 and q["cancel_pending_ms"] is None
    assert q["token_wait_ms"] == 3100.0
    snap = {"at": 105.5, "prefix": "x", "races": [row], "counts": {"racing": 1}}
    assert "p:cancelling/QUEUED cancel+4.5s" in render(snap)


def test_a_race_whose_state_hash_holds_only_its_deadline_shows_as_expired(redis_client, prefix):
    """What is left when the state expired and a late caller's deadline write made the hash
    again: no version, so no state; the race shows with its live job, not an error."""
    from gpuhedge_celery.commands.watch import snapshot
    from gpuhedge_celery.store.races import RaceStore

    store = RaceStore(redis_client, prefix)
    keys = store.shards.race("r-gone")
    redis_client.hset(keys.state, "deadline", "123.0")
    redis_client.hset(keys.jobs, "a1", json.dumps({"provider": "p", "job_id": "j1"}))
    redis_client.zadd(store.shards.index_of("r-gone").live, {"r-gone": 1})
    rows = snapshot(store)["races"]
    assert [r["race_id"] for r in rows] == ["r-gone"]
    assert rows[0]["status"] == "expired"
