"""``cancel-audit`` and ``rounds``: jobs through each adapter directly, --go-gated and budgeted.

Against simulated providers on compressed time, and the loopback RunPod fake (a real HTTP
server in its own process) for the cancel audit.
"""

from __future__ import annotations

import json

import pytest
import yaml

from gpuhedge_celery.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from gpuhedge_celery.providers.simledger import get_default_ledger, seq_key
from gpuhedge_celery.store.budget import BudgetStore
from tests.support.runpod_fake import KEY, runpod_block

pytestmark = pytest.mark.timeout(120)

SIM = {
    "time_scale": 0.01,
    "providers": {
        "p": {"role": "primary", "adapter": "sim", "billed_rate_per_s": 0.0003,
              "idle_billed_seconds": 60,
              "sim": {"seed": 1, "slow_probability": 0.5, "fast": {"queue_s": 1, "run_s": 4},
                      "slow": {"queue_s": 20, "run_s": 10},
                      "cancel": {"ack_s": 0.28, "terminal_s": 0.35}}},
        "h": {"role": "hedge", "adapter": "sim", "billed_rate_per_s": 0.0007,
              "sim": {"seed": 2, "slow_probability": 0, "fast": {"queue_s": 0.5, "run_s": 5}}},
    },
    "timeouts": {"attempt_cap_s": 180},
    "validator": "wav",
}  # fmt: skip


@pytest.fixture
def cli(tmp_path, redis_url, prefix, capsys, monkeypatch):
    """``cli(config, *args) -> (code, out, err)``: the CLI on a config written from a dict."""
    monkeypatch.delenv("GPUHEDGE_CONFIG", raising=False)

    def run(config, *args):
        path = tmp_path / "measure.yaml"
        path.write_text(yaml.safe_dump(config))
        code = main(["--redis-url", redis_url, "--prefix", prefix, "--config", str(path), *args])
        out = capsys.readouterr()
        assert KEY not in out.out + out.err
        return code, out.out, out.err

    return run


def submits(name: str) -> int:
    return int(get_default_ledger().get(seq_key(name)) or 0)


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cancel_audit_sends_nothing_without_go(cli, tmp_path):
    before = submits("p")
    out_file = tmp_path / "audit.jsonl"
    code, out, err = cli(SIM, "cancel-audit", "--providers", "p,h", "--repeats", "2",
                         "--out", str(out_file))  # fmt: skip
    assert code == EXIT_USAGE and "add --go" in err and not out_file.exists()
    assert "would cancel 4 job(s) on each of 2 provider(s)" in out
    # 4 jobs each at (cap 180 s + idle) x rate
    worst = 4 * ((180 + 60) * 0.0003 + 180 * 0.0007)
    assert f"worst-case spend: ${worst:,.4f}" in out
    assert submits("p") == before


def test_cancel_audit_on_sims_confirms_every_cancel(cli, tmp_path):
    out_file = tmp_path / "audit.jsonl"
    code, out, _ = cli(SIM, "cancel-audit", "--providers", "p,h", "--repeats", "2",
                       "--early-s", "0.2", "--out", str(out_file), "--go")  # fmt: skip
    assert code == EXIT_OK, out
    records = lines(out_file)
    cancels = [r for r in records if r["kind"] == "forced_cancel"]
    [summary] = [r for r in records if r["kind"] == "cancel_audit_summary"]
    assert len(cancels) == 8 and records[-1] is not cancels[-1]
    matrix = summary["matrix"]
    for provider in ("p", "h"):
        for phase in ("early", "late"):
            cell = matrix[provider][phase]
            assert cell["attempts"] == cell["terminal"] == 2 and cell["leaked"] == 0
    # early on p: still queued (its queue is 1 s or 20 s), never running; late: running
    assert matrix["p"]["early"]["was_running"] == 0 and matrix["p"]["late"]["was_running"] == 2
    assert matrix["h"]["late"]["was_running"] == 2
    early_p = [c for c in cancels if c["provider"] == "p" and c["phase"] == "early"]
    assert {c["state_before_cancel"] for c in early_p} == {"QUEUED"}
    assert all(c["receipt"]["scope"] == "queued_job" for c in early_p)
    late = [c for c in cancels if c["phase"] == "late"]
    assert {c["state_before_cancel"] for c in late} == {"IN_PROGRESS"}
    assert all(c["receipt"]["terminal_status"] == "CANCELLED" for c in late)
    assert out.splitlines()[0].split() == ["provider", "phase", "attempts", "terminal",
                                           "leaked", "was_running"]  # fmt: skip


def test_cancel_audit_through_the_runpod_adapter(cli, runpod, tmp_path, monkeypatch, redis_client,
                                                  prefix):  # fmt: skip
    monkeypatch.setenv("RUNPOD_TEST_KEY", KEY)
    runpod.configure(queue_s=0.4, run_s=5.0, cancel_stop_s=0.05)
    config = {
        "providers": {"rp": {"adapter": "runpod", "billed_rate_per_s": 0.001,
                             "runpod": runpod_block(runpod)}},
        "timeouts": {"attempt_cap_s": 20},
        "budget": {"ceiling_usd": 100},
    }  # fmt: skip
    out_file = tmp_path / "rp.jsonl"
    code, out, _ = cli(config, "cancel-audit", "--providers", "rp", "--repeats", "2",
                       "--early-s", "0", "--late-s", "0.1", "--out", str(out_file),
                       "--go", "--json")  # fmt: skip
    assert code == EXIT_OK, out
    summary = json.loads(out)
    assert summary["matrix"]["rp"] == {
        "early": {"attempts": 2, "terminal": 2, "leaked": 0, "was_running": 0},
        "late": {"attempts": 2, "terminal": 2, "leaked": 0, "was_running": 2},
    }
    assert runpod.route("ep1", "run")["requests"] == 4
    assert runpod.route("ep1", "cancel")["requests"] >= 4
    assert KEY not in out_file.read_text()
    cancels = [r for r in lines(out_file) if r["kind"] == "forced_cancel"]
    assert {c["state_before_cancel"] for c in cancels if c["phase"] == "early"} == {"QUEUED"}
    # budgeted: every job reserved its worst case and settled; nothing is left open
    budget = BudgetStore(redis_client, prefix)
    entries = [e for _, e in budget.entries()]
    assert sum(e["type"] == "reserve" for e in entries) == 4
    assert sum(e["type"] == "settle" for e in entries) >= 4
    assert budget.open_count() == 0


def test_cancel_audit_stops_when_the_budget_refuses(cli, tmp_path):
    config = {**SIM, "budget": {"max_usd_per_day": 0.01}}  # under one job's worst case
    before = submits("h")
    code, _, err = cli(config, "cancel-audit", "--providers", "h", "--repeats", "1", "--go")
    assert code == EXIT_FAILED and submits("h") == before
    [line] = err.strip().splitlines()
    assert line.startswith("error: h job early-1-h not submitted: ") and "max_usd_per_day" in line


def test_cancel_audit_bad_input_is_one_line(cli):
    code, _, err = cli(SIM, "cancel-audit", "--providers", "p,nope", "--go")
    assert code == EXIT_USAGE
    assert err.strip() == "error: --providers: no provider 'nope' (known: h, p)"
    code, _, err = cli(SIM, "cancel-audit", "--request", "[1]", "--go")
    assert code == EXIT_USAGE and err.strip() == "error: REQUEST: expected a JSON object, got list"


def test_rounds_write_traces_that_replay_reads(cli, tmp_path, capsys):
    traces = tmp_path / "rounds.jsonl"
    before = submits("h")
    code, out, err = cli(SIM, "rounds", "--rounds", "3", "--out", str(traces))
    assert code == EXIT_USAGE and "add --go" in err and not traces.exists()
    assert submits("h") == before and "would run 3 paired round(s) of 2 provider(s)" in out
    code, out, _ = cli(SIM, "rounds", "--rounds", "4", "--wait", "0", "--out", str(traces), "--go")
    assert code == EXIT_OK, out
    rounds = lines(traces)
    assert [r["round_id"] for r in rounds] == [1, 2, 3, 4]
    for r in rounds:
        assert r["kind"] == "round" and set(r["providers"]) == {"p", "h"}
        h, p = r["providers"]["h"], r["providers"]["p"]
        # provider seconds (time_scale 0.01 undone): h queues 0.5 s and runs 5 s
        assert h["valid"] and h["wall_s"] == pytest.approx(5.5, abs=0.3)
        assert h["metrics"]["queue_delay_ms"] == pytest.approx(500)
        assert p["wall_s"] == pytest.approx(5.0, abs=0.3) or p["wall_s"] == pytest.approx(
            30, abs=0.5
        )
        assert r["winner"] == min(("p", "h"), key=lambda n: r["providers"][n]["wall_s"])
    # the same file, replayed: the single policies reproduce what the rounds measured
    rates = ["--rate", "p=0.0003:60", "--rate", "h=0.0007"]
    args = ["--policy", "single:h", "--policy", "single:p", "--json", "--subset", "all"]
    code = main(["replay", str(traces), *rates, *args])
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == EXIT_OK and rows["single:h"]["n"] == 4
    p_walls = sorted(r["providers"]["p"]["wall_s"] for r in rounds)
    assert rows["single:p"]["max_s"] == pytest.approx(p_walls[-1])
    # an existing file needs --append; then round ids continue
    code, _, err = cli(SIM, "rounds", "--rounds", "1", "--out", str(traces), "--go")
    assert code == EXIT_USAGE and err.strip().endswith("exists: add --append to add rounds to it, "
                                                       "or name a new file")  # fmt: skip
    code, _, _ = cli(SIM, "rounds", "--rounds", "1", "--wait", "0", "--out", str(traces),
                     "--append", "--go")  # fmt: skip
    assert code == EXIT_OK and [r["round_id"] for r in lines(traces)] == [1, 2, 3, 4, 5]


def test_rounds_bad_input_is_one_line(cli, tmp_path):
    out = str(tmp_path / "x.jsonl")
    code, _, err = cli(SIM, "rounds", "--providers", "p", "--out", out, "--go")
    assert code == EXIT_USAGE
    assert err.strip() == "error: --providers: a paired round needs at least two providers"
    code, _, err = cli(SIM, "rounds", "--request", "not json", "--out", out, "--go")
    assert code == EXIT_USAGE and err.strip().startswith("error: REQUEST: not JSON")


def test_a_round_whose_submit_fails_records_it_and_replay_reads_it(cli, tmp_path, capsys):
    traces = tmp_path / "rounds.jsonl"
    request = json.dumps({"sim": {"h": {"outcome": "submit_error"}}})
    code, _, _ = cli(SIM, "rounds", "--rounds", "2", "--wait", "0", "--request", request,
                     "--out", str(traces), "--go")  # fmt: skip
    assert code == EXIT_OK
    for r in lines(traces):
        h = r["providers"]["h"]
        assert h["state"] == "SUBMIT_FAILED" and not h["valid"] and "simulated submit" in h["error"]
        assert r["winner"] == "p"
    code = main(["replay", str(traces), "--policy", "hedge:h->p@0s", "--rate", "p=0.0003:60",
                 "--rate", "h=0.0007", "--json", "--subset", "all"])  # fmt: skip
    [row] = json.loads(capsys.readouterr().out)
    assert code == EXIT_OK and row["n"] == 2 and row["max_s"] is not None  # p rescued both


def test_cancel_audit_counts_a_cancel_runpod_never_confirms_as_leaked(cli, runpod, tmp_path,
                                                                      monkeypatch):  # fmt: skip
    monkeypatch.setenv("RUNPOD_TEST_KEY", KEY)
    runpod.configure(queue_s=0.2, run_s=5.0, faults={"status": {"error_rate": 1.0}})
    config = {
        "providers": {"rp": {"adapter": "runpod", "billed_rate_per_s": 0.001,
                             "runpod": runpod_block(runpod, cancel_confirm_s=0.5)}},
        "budget": {"ceiling_usd": 100},
    }  # fmt: skip
    code, out, _ = cli(config, "cancel-audit", "--providers", "rp", "--repeats", "1",
                       "--early-s", "0", "--go", "--json")  # fmt: skip
    # /status always fails: every cancel is acknowledged, none is seen terminal
    assert code == EXIT_FAILED
    cells = json.loads(out)["matrix"]["rp"]
    for phase in ("early", "late"):
        assert cells[phase]["attempts"] == cells[phase]["leaked"] == 1
        assert cells[phase]["terminal"] == 0
    assert runpod.route("ep1", "cancel")["requests"] >= 2


@pytest.mark.timeout(90)
def test_an_interrupted_rounds_run_cancels_its_running_jobs(runpod, tmp_path, redis_url, prefix):
    """Ctrl-C (SIGINT) in the middle of a round: both paid jobs are cancelled natively and the
    command says so, rather than leaving them running at the provider."""
    import os
    import signal
    import subprocess
    import sys
    import time

    runpod.configure(queue_s=0.2, run_s=60.0, cancel_stop_s=0.05)
    config = {
        "providers": {
            "a": {"adapter": "runpod", "billed_rate_per_s": 0.001,
                  "runpod": runpod_block(runpod, "ep1")},
            "b": {"adapter": "runpod", "billed_rate_per_s": 0.001,
                  "runpod": runpod_block(runpod, "ep2")},
        },
        "timeouts": {"attempt_cap_s": 120},
        "budget": {"ceiling_usd": 100},
    }  # fmt: skip
    path = tmp_path / "rounds.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "RUNPOD_TEST_KEY": KEY, "PYTHONFAULTHANDLER": "1"}
    env.pop("GPUHEDGE_CONFIG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuhedge_celery", "--redis-url", redis_url, "--prefix", prefix,
         "--config", str(path), "rounds", "--rounds", "2", "--wait", "0",
         "--out", str(tmp_path / "r.jsonl"), "--go"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # Ctrl-C as at a terminal: a test run started in the background (nohup, CI) ignores
        # SIGINT, the child would inherit that and Python then installs no handler for it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        give_up = time.monotonic() + 30
        while runpod.route("ep1", "run")["requests"] + runpod.route("ep2", "run")["requests"] < 2:
            assert time.monotonic() < give_up, "the round never submitted its jobs"
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.5)  # both jobs are queued or running at the fake
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # where it hangs: every thread's stack (faulthandler)
            proc.send_signal(signal.SIGABRT)
            out, err = proc.communicate(timeout=10)
            pytest.fail(f"no exit 30 s after SIGINT; its stderr:\n{err[-6000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted: cancelling the jobs still running" in err
    assert err.count("cancelled (confirmed)") == 2 and "LEAKED" not in err, err
    assert runpod.route("ep1", "cancel")["requests"] >= 1
    assert runpod.route("ep2", "cancel")["requests"] >= 1
    assert KEY not in out + err
