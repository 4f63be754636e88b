"""Budgets in real races: real Celery workers, real Redis, sim providers on compressed time.

Worst cases here (provider time): ``p`` caps at 100 s at $0.0003/s plus a 60 s idle window =
$0.048; ``h`` caps at 100 s at $0.0007/s = $0.07. The per-request cap ($0.10) fits one of each
but not both, so a hedge is refused; key ``tiny`` cannot afford even a primary.
"""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from gpuhedge_celery.cli import cli
from gpuhedge_celery.core.budget import to_nano
from gpuhedge_celery.errors import BudgetExceeded, ConfigError, RaceFailed
from gpuhedge_celery.store.budget import BudgetStore
from tests.support.budget_config import HEDGED_SIM_CONFIG
from tests.support.fixtures_celery import broker_url_for
from tests.support.fixtures_races import start_race_cluster, stop_race_cluster
from tests.test_flower_events import EventLog

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.brokers,
    pytest.mark.sentinel,
    pytest.mark.cluster,
]

CONFIG = (
    HEDGED_SIM_CONFIG
    + """budget:
  max_usd_per_request: 0.10
  ceiling_usd: 100
  keys:
    tiny: {max_usd_total: 0.01}
    tenant-a: {max_usd_per_day: 5}
  default_key: tenant-a
validator: wav
"""
)
P_WORST, H_WORST = 0.048, 0.07


@pytest.fixture(scope="module")
def budget_cluster(redis_url, tmp_path_factory, broker, request):
    rc = start_race_cluster(redis_url, tmp_path_factory.mktemp("budget"), config=CONFIG,
                            broker_url=broker_url_for(broker, request))  # fmt: skip
    rc.budget = BudgetStore(rc.client, rc.prefix)
    yield rc
    stop_race_cluster(rc)


def attempts_by_role(receipt):
    return {a["role"]: a for a in receipt["attempts"]}


def test_a_refused_hedge_leaves_the_primary_racing_alone(budget_cluster):
    rc = budget_cluster
    # the primary runs 60 provider s (0.6 s); the hedge is due at 10 s but would pass $0.10
    request = {"sim": {"p": {"queue_s": 1, "run_s": 60}}}
    res = rc.send(request, policy="hedge:p->h@0.1s", budget_key="tenant-a")
    out = res.get(timeout=30)
    assert out["winner"] == "p" and out["hedged"] is False and out["budget_refused"] is True
    receipt = rc.receipt(res.id)
    hedge = attempts_by_role(receipt)["hedge"]
    assert hedge["reasons"][0].startswith("budget: refused by max_usd_per_request")
    assert hedge["handle"] is None and hedge["job_id"] == ""  # never submitted
    assert receipt["budget_key"] == "tenant-a" and receipt["failure_reason"] is None
    # the primary's reservation settled to its reported cost; the hedge never reserved
    record = rc.budget.reservation(res.id, "a1")
    assert record["source"] == "reconciled" and int(record["amount"]) == to_nano(P_WORST)
    assert int(record["settled"]) < int(record["amount"])
    assert rc.budget.reservation(res.id, "a2") is None
    refusals = [e for _, e in rc.budget.entries() if e["type"] == "refuse" and e["race"] == res.id]
    assert [e["attempt"] for e in refusals] == ["a2"]


def test_a_refused_hedge_is_no_hedge_in_the_result_receipt_record_events_and_report(
    budget_cluster, tmp_path
):
    rc = budget_cluster
    since = time.time()
    request = {"sim": {"p": {"queue_s": 1, "run_s": 60}}}
    with EventLog(rc.app) as log:
        res = rc.send(request, policy="hedge:p->h@0.1s", budget_key="tenant-a")
        out = res.get(timeout=30)
        receipt = rc.receipt(res.id)
        log.wait_for(res.id, {"task-won", "task-succeeded"})
        time.sleep(0.5)  # a late event would have been gathered and published by now
        names = [e["type"] for e in log.events if e.get("uuid") == res.id]
    # the caller's result: primary alone, no hedge, the refusal said
    assert (out["winner"], out["hedged"], out["budget_refused"]) == ("p", False, True)
    assert "task-hedge_launched" not in names, names  # nor counted in races_hedged
    # the receipt: the hedge was never sent, so nothing was cancelled, confirmed or paid
    assert receipt["hedged"] is False and receipt["budget_refused"] is True
    assert receipt["leaked"] is False and receipt["wasted_usd"] == 0.0
    hedge = attempts_by_role(receipt)["hedge"]
    assert hedge["sent"] is False and hedge["state"] is None
    assert attempts_by_role(receipt)["primary"]["sent"] is True
    cancel = hedge["cancel_receipt"]
    assert cancel["evidence"] == "no_evidence" and cancel["confirmed_terminal"] is False
    assert cancel["terminal_status"] is None and cancel["cancel_sent_ms"] is None
    assert cancel["leaked"] is False and cancel["estimated_cost_usd"] == 0.0
    assert cancel["note"].startswith("not sent: budget: refused by max_usd_per_request: $0.1 cap")
    # the receipt command: JSON as stored, and its text
    base = ["--redis-url", rc.redis_url, "--prefix", rc.prefix]
    shown = CliRunner().invoke(cli, [*base, "receipt", res.id, "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["attempts"] == receipt["attempts"]
    text = CliRunner().invoke(cli, [*base, "receipt", res.id]).output
    flags = next(line for line in text.splitlines() if line.startswith("flags"))
    assert "budget_refused" in flags and "hedged" not in flags
    (hedge_line,) = [line for line in text.splitlines() if " hedge " in line]
    assert "not sent" in hedge_line and "FAILED" not in hedge_line
    assert "     not sent: budget: refused by max_usd_per_request: $0.1 cap" in text
    assert "confirmed_terminal" not in text  # the primary won; the hedge had nothing to cancel
    # the record, in the stream and exported; report's hedge rate over it
    (record,) = [r for _, r in rc.store.records.read(int(since * 1000)) if r["race_id"] == res.id]
    assert record["hedged"] is False and record["budget_refused"] is True
    roles = {a["role"]: a for a in record["attempts"]}
    assert roles["hedge"]["sent"] is False and roles["hedge"]["usd"] == 0.0
    assert "sent" not in roles["primary"] and record["cancels"] == []
    exported = tmp_path / "records.jsonl"
    dump = CliRunner().invoke(cli, [*base, "records", "export", "--since", str(since)])
    assert dump.exit_code == 0, dump.output
    exported.write_text("".join(line + "\n" for line in dump.stdout.splitlines()
                                if json.loads(line)["race_id"] == res.id))  # fmt: skip
    report = CliRunner().invoke(cli, ["report", str(exported), "--json"])
    assert report.exit_code == 0, report.output
    (group,) = json.loads(report.output)["groups"]
    assert (group["n"], group["hedged"], group["hedge_rate"]) == (1, 0, 0.0)


def test_a_refused_primary_fails_the_race_with_reason_budget(budget_cluster):
    rc = budget_cluster
    res = rc.send({}, budget_key="tiny")
    with pytest.raises(BudgetExceeded) as caught:
        res.get(timeout=30)
    err = caught.value
    assert isinstance(err, RaceFailed) and err.reason == "budget"
    assert "refused by keys.tiny.max_usd_total" in str(err)
    receipt = err.receipt
    assert receipt["failure_reason"] == "budget" and receipt["winner"] is None
    assert [a["role"] for a in receipt["attempts"]] == ["primary"]  # no hedge was launched
    assert rc.budget.reservation(res.id, "a1") is None


def test_an_unknown_budget_key_is_a_one_line_error(budget_cluster):
    rc = budget_cluster
    with pytest.raises(ConfigError) as caught:
        rc.send({}, budget_key="no spaces allowed").get(timeout=30)
    assert "budget_key" in str(caught.value) and "\n" not in str(caught.value)


def test_a_key_not_in_the_config_is_refused_and_no_key_is_charged_to_the_default(
    budget_cluster,
):
    rc = budget_cluster
    with pytest.raises(ConfigError) as caught:
        rc.send({}, budget_key="tenant-new").get(timeout=30)
    line = str(caught.value)
    assert line.startswith("budget_key: no budget for key 'tenant-new'") and "\n" not in line
    res = rc.send({"sim": {"p": {"queue_s": 0.5, "run_s": 2}}}, policy="single")
    assert res.get(timeout=30)["winner"] == "p"
    receipt = rc.receipt(res.id)
    assert receipt["budget_key"] == "tenant-a"  # the config's default_key
    keys = {e["key"] for _, e in rc.budget.entries() if e.get("race") == res.id}
    assert keys == {"tenant-a"}


def test_every_attempt_settles_and_the_ledger_adds_up(budget_cluster):
    rc = budget_cluster
    # a hedged race whose hedge fits the request cap: no hedge at all is cheaper, so make the
    # primary fail and the cap per request fit primary + hedge by sending no key
    request = {"sim": {"p": {"queue_s": 0.5, "run_s": 2, "outcome": "failed"}}}
    res = rc.send(request, policy="single")
    with pytest.raises(RaceFailed) as caught:
        res.get(timeout=30)
    assert caught.value.reason == "no_valid_result"
    rc.receipt(res.id)
    # nothing of any race stays reserved once they are finished
    totals = rc.budget.totals()
    assert totals.get("r|all", 0) == 0 and rc.budget.open_count() == 0
    spent = sum(int(e["nano"]) for _, e in rc.budget.entries() if e["type"] == "settle")
    assert totals["s|all"] == spent > 0


def test_the_race_command_sends_only_with_go(budget_cluster, monkeypatch, capsys):
    import json

    from gpuhedge_celery.cli import main
    from gpuhedge_celery.providers.simledger import seq_key

    rc = budget_cluster
    monkeypatch.setenv("GPUHEDGE_BROKER_PREFIX", f"{rc.prefix}:")  # the workers' broker keys
    if rc.cluster.broker_url is None:  # the workers' broker: the test Redis, or their vhost
        monkeypatch.delenv("GPUHEDGE_BROKER_URL", raising=False)
    else:
        monkeypatch.setenv("GPUHEDGE_BROKER_URL", rc.cluster.broker_url)
    request = json.dumps({"sim": {"p": {"queue_s": 0, "run_s": 1}}})
    base = ["--redis-url", rc.redis_url, "--prefix", rc.prefix, "--config", str(rc.config_path),
            "race", request, "--policy", "single"]  # fmt: skip

    def submits() -> int:
        return int(rc.ledger.get(seq_key("p")) or 0)

    before = submits()
    assert main(base) == 2  # a dry run: nothing sent
    out = capsys.readouterr()
    assert f"worst-case spend: ${P_WORST:,.4f}" in out.out and "add --go" in out.err
    assert submits() == before
    assert main([*base, "--go", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["winner"] == "p" and "payload" not in result and submits() == before + 1
    assert main([*base, "--budget-key", "tiny", "--go"]) == 1  # refused by the budget
    err = capsys.readouterr().err
    assert "failed (budget)" in err and "refused by keys.tiny.max_usd_total" in err
    assert submits() == before + 1
