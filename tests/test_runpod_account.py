"""The ``runpod`` adapter's account hooks against the loopback fake (a real HTTP server process):
``login-check`` through GraphQL ``myself { id }`` and ``costs`` from balance snapshots."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from gpuhedge_celery.cli import EXIT_FAILED, EXIT_OK, main
from gpuhedge_celery.config import parse_config
from gpuhedge_celery.core.budget import to_nano
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.providers.runpod_account import BALANCE_DERIVED, FIRST
from gpuhedge_celery.store.balances import BalanceStore
from gpuhedge_celery.store.budget import BudgetStore
from tests.support.runpod_fake import KEY, runpod_block, runpod_provider


@pytest.fixture
def cli(runpod, monkeypatch, tmp_path, redis_url, prefix):
    """``run(*args) -> (exit code, stdout)`` on a config with one runpod provider on the fake."""
    config = {
        "providers": {"rp": {"adapter": "runpod", "billed_rate_per_s": 0.001,
                             "runpod": runpod_block(runpod)}},
        "budget": {"ceiling_usd": 100},
    }  # fmt: skip
    path = tmp_path / "rp.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("RUNPOD_TEST_KEY", KEY)
    monkeypatch.delenv("GPUHEDGE_CONFIG", raising=False)

    def run(capsys, *args):
        code = main(["--redis-url", redis_url, "--prefix", prefix, "--config", str(path), *args])
        out = capsys.readouterr()
        assert KEY not in out.out + out.err, args
        return code, out.out

    return run


def test_login_check_names_the_account_and_fails_in_one_line(runpod, cli, capsys, monkeypatch):
    runpod.configure(account_id="acct-42")
    code, out = cli(capsys, "login-check", "--json")
    [row] = json.loads(out)
    assert code == EXIT_OK and row["status"] == "ok"
    assert row["identity"] == "acct-42"
    assert runpod.route("ep1", "run")["requests"] == 0  # read-only: nothing submitted
    # a GraphQL error (HTTP 200) that even repeats the key: failed, one line, the key scrubbed
    runpod.configure(faults={"graphql": {"errors_next": 1, "error_message": f"bad {KEY}"}})
    code, out = cli(capsys, "login-check")
    [line] = out.splitlines()[1:]
    assert code == EXIT_FAILED and " failed " in line and "GraphQL error: bad <redacted>" in line
    # a key RunPod refuses
    monkeypatch.setenv("RUNPOD_TEST_KEY", "rp-wrong-key-000")
    code, out = cli(capsys, "login-check")
    [line] = out.splitlines()[1:]
    assert code == EXIT_FAILED and "HTTP 401: key refused" in line and "rp-wrong" not in line


def test_costs_reports_the_balance_drop_between_snapshots_and_records_it(
    runpod, cli, capsys, redis_client, prefix
):
    rate, run_s, idle_s = 0.01, 0.2, 0.15
    runpod.configure(balance_usd_per_s=rate, balance_idle_s=idle_s)
    code, out = cli(capsys, "costs", "--json")
    [row] = json.loads(out)
    assert code == EXIT_OK and row["status"] == "unavailable" and row["detail"] == FIRST
    assert len(BalanceStore(redis_client, prefix).all("rp")) == 1
    # one job runs on the endpoint; its idle window passes
    provider = runpod_provider(runpod)
    handle = provider.submit({"runpod_fake": {"*": {"queue_s": 0.0, "run_s": run_s}}})
    assert provider.result(handle, 5.0).state.value == "COMPLETED"
    time.sleep(idle_s + 0.05)
    code, out = cli(capsys, "costs", "--json")
    [row] = json.loads(out)
    assert code == EXIT_OK and row["status"] == "ok", row
    assert row["reported_usd"] == pytest.approx((run_s + idle_s) * rate, abs=1e-9)
    assert row["ledger_usd"] == 0 and row["difference_usd"] == row["reported_usd"]
    assert row["detail"].startswith(BALANCE_DERIVED)
    records = [e for _, e in BudgetStore(redis_client, prefix).entries()
               if e["type"] == "reconcile"]  # fmt: skip
    assert len(records) == 1 and records[0]["provider"] == "rp"
    assert int(records[0]["reported_nano"]) == to_nano(row["reported_usd"])
    assert len(BalanceStore(redis_client, prefix).all("rp")) == 2
    # a deposit between snapshots: spend cannot be derived across it
    runpod.configure(balance_usd=1000.0)
    code, out = cli(capsys, "costs", "--json")
    [row] = json.loads(out)
    assert row["status"] == "unavailable" and "it rose" in row["detail"]


def test_a_graphql_error_in_costs_is_one_line_and_records_nothing(
    runpod, cli, capsys, redis_client, prefix
):
    runpod.configure(faults={"graphql": {"errors_next": 1, "error_message": "try later"}})
    code, out = cli(capsys, "costs")
    [line] = out.splitlines()[1:]
    assert code == EXIT_OK and "GraphQL error: try later" in line
    assert BalanceStore(redis_client, prefix).all("rp") == []


def test_graphql_url_is_checked_at_load(runpod):
    block = runpod_block(runpod, graphql_url="ftp://x")
    with pytest.raises(ConfigError) as e:
        parse_config({"providers": {"rp": {"adapter": "runpod", "runpod": block}},
                      "budget": {"ceiling_usd": 1}}, source="rp.yaml")  # fmt: skip
    assert "providers.rp.runpod.graphql_url" in str(e.value) and "\n" not in str(e.value)
