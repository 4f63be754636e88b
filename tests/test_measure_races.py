"""``infer`` and ``experiment`` on real Celery workers racing sim providers, and the whole chain:
rounds -> replay -> experiment -> report --by arm, without spending anything."""

from __future__ import annotations

import json

import pytest
import yaml

from gpuhedge_celery.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from gpuhedge_celery.providers.simledger import seq_key
from tests.support.fixtures_races import start_race_cluster, stop_race_cluster

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def measure_cluster(redis_url, tmp_path_factory):
    rc = start_race_cluster(redis_url, tmp_path_factory.mktemp("measure"))
    yield rc
    stop_race_cluster(rc)


@pytest.fixture
def cli(measure_cluster, monkeypatch, capsys):
    """``cli(*args) -> (code, out, err)`` on the cluster's Redis, prefix and config."""
    rc = measure_cluster
    monkeypatch.setenv("GPUHEDGE_BROKER_PREFIX", f"{rc.prefix}:")  # the workers' broker keys
    monkeypatch.delenv("GPUHEDGE_CONFIG", raising=False)
    base = ["--redis-url", rc.redis_url, "--prefix", rc.prefix, "--config", str(rc.config_path)]

    def run(*args):
        code = main([*base, *args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def submits(rc, name: str) -> int:
    return int(rc.ledger.get(seq_key(name)) or 0)


def test_infer_sends_only_with_go_and_prints_the_final_receipt(measure_cluster, cli):
    rc = measure_cluster
    request = json.dumps({"sim": {"p": {"queue_s": 0, "run_s": 1}}})
    before = submits(rc, "p")
    code, out, err = cli("infer", request, "--policy", "single")
    assert code == EXIT_USAGE and "worst-case spend: $" in out and "add --go" in err
    assert submits(rc, "p") == before
    code, out, _ = cli("infer", request, "--policy", "single", "--go")
    assert code == EXIT_OK, out
    lines = out.splitlines()
    assert lines[0].startswith("race ") and "(in flight)" not in lines[0]
    assert lines[2].startswith("winner    p (") and submits(rc, "p") == before + 1
    # a hedged race: the primary is slow, the hedge wins, and the receipt shows the cancel
    slow = json.dumps({"sim": {"p": {"queue_s": 60, "run_s": 1}}})
    code, out, _ = cli("infer", slow, "--policy", "hedge:p->h@0.05s", "--go", "--json")
    receipt = json.loads(out)
    assert code == EXIT_OK and receipt["finished"] and receipt["winner_provider"] == "h"
    [primary] = [a for a in receipt["attempts"] if a["role"] == "primary"]
    assert primary["cancel_receipt"]["evidence"] == "confirmed_terminal"


def test_infer_of_a_failed_race_prints_its_receipt_and_exits_1(cli):
    bad = json.dumps({"sim": {"p": {"queue_s": 0, "run_s": 1, "outcome": "failed"}}})
    code, out, err = cli("infer", bad, "--policy", "single", "--go")
    assert code == EXIT_FAILED and "winner    none" in out and "failed (no_valid_result)" in err
    code, _, err = cli("infer", "{}", "--policy", "nope:x", "--go")
    assert code == EXIT_USAGE and len(err.strip().splitlines()) == 1 and "policy" in err


def test_experiment_dry_run_and_gate_send_nothing(measure_cluster, cli, tmp_path):
    rc = measure_cluster
    plan = {"seed": 3, "arms": [{"name": "solo", "policy": "single", "providers": ["p"]},
                                {"name": "hedged", "policy": "hedge:p->h@0.1s"}],
            "blocks_per_arm": 2, "block_size": 1, "cadence_s": 0,
            "primary_metric": "p50"}  # fmt: skip
    path = tmp_path / "prereg.yaml"
    path.write_text(yaml.safe_dump(plan))
    before = submits(rc, "p")
    code, out, _ = cli("experiment", str(path), "--dry-run")
    assert code == EXIT_OK and "block order (seed 3): " in out and "worst-case spend: $" in out
    code, out, err = cli("experiment", str(path))
    assert code == EXIT_USAGE and "add --go" in err and submits(rc, "p") == before
    # an arm whose policy the config cannot race: one line naming the file and the arm
    plan["arms"][1]["policy"] = "hedge:p->zz@1s"
    path.write_text(yaml.safe_dump(plan))
    code, _, err = cli("experiment", str(path), "--dry-run")
    [line] = err.strip().splitlines()
    assert code == EXIT_USAGE and line.startswith(f"error: {path}: arms[1]: ") and "'zz'" in line


def test_rounds_replay_experiment_report_chain(measure_cluster, cli, tmp_path):
    rc = measure_cluster
    # 1. paired rounds on the cluster's sim providers, written as traces
    traces = tmp_path / "rounds.jsonl"
    code, out, _ = cli("rounds", "--rounds", "3", "--wait", "0", "--providers", "p,h",
                       "--out", str(traces), "--go")  # fmt: skip
    assert code == EXIT_OK, out
    # 2. replay reads them
    rates = ["--rate", "p=0.0003:60", "--rate", "h=0.0007"]
    code, out, _ = cli("replay", str(traces), "--policy", "single:p", "--policy",
                       "hedge:p->h@10s", *rates, "--json")  # fmt: skip
    rows = json.loads(out)
    assert code == EXIT_OK and {r["policy"] for r in rows} == {"single:p", "hedge:p->h@10s"}
    assert all(r["n"] == 3 for r in rows if r["subset"] == "all")
    # 3. a preregistered experiment of two arms on the workers
    plan = {"name": "chain", "seed": 5,
            "arms": [{"name": "solo", "policy": "single", "providers": ["p"]},
                     {"name": "hedged", "policy": "hedge:p->h@0.02s"}],
            "blocks_per_arm": 2, "block_size": 2, "cadence_s": 0.05, "primary_metric": "p95",
            "request": {"sim": {"p": {"queue_s": 2, "run_s": 1}}}}  # fmt: skip
    prereg = tmp_path / "prereg.yaml"
    prereg.write_text(yaml.safe_dump(plan))
    records = tmp_path / "experiment.jsonl"
    code, out, err = cli("experiment", str(prereg), "--go", "--out", str(records))
    assert code == EXIT_OK, out + err
    assert "primary metric p95:" in out
    lines = [json.loads(x) for x in records.read_text().splitlines()]
    assert lines[0]["kind"] == "experiment_plan" and lines[0]["seed"] == 5
    races = lines[1:]
    assert len(races) == 8 and all(r["kind"] == "race" for r in races)
    assert [r["arm"] for r in races] == lines[0]["order"]  # the seeded order, as sent
    by_arm = {arm: [r for r in races if r["arm"] == arm] for arm in ("solo", "hedged")}
    assert {r["policy"] for r in by_arm["solo"]} == {"single:p"}
    assert all(r["hedged"] for r in by_arm["hedged"]) and not any(
        r["hedged"] for r in by_arm["solo"]
    )
    # 4. report --by arm over the experiment's records, and over the stream's export
    code, out, _ = cli("report", str(records), "--by", "arm", "--json")
    report = json.loads(out)
    assert code == EXIT_OK and report["skipped"] == {"experiment_plan": 1}
    groups = {g["group"]: g for g in report["groups"]}
    assert set(groups) == {"solo", "hedged"} and groups["solo"]["n"] == groups["hedged"]["n"] == 4
    assert groups["hedged"]["hedge_rate"] == 1.0 and groups["solo"]["hedge_rate"] == 0.0
    code, out, _ = cli("records", "export")
    exported = tmp_path / "export.jsonl"
    exported.write_text(out)
    code, out, _ = cli("report", str(exported), "--by", "arm", "--json")
    streamed = {g["group"]: g["n"] for g in json.loads(out)["groups"]}
    assert streamed["solo"] == streamed["hedged"] == 4  # other tests' races: group "-"
    assert submits(rc, "h") > 0
