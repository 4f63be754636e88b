"""The ``cerebrium`` adapter's account hooks against its loopback fake (a real HTTP server
process): ``login-check`` reads the app from the management API, ``costs`` is unavailable."""

from __future__ import annotations

import json

import pytest
import yaml

from gpuhedge_celery.cli import EXIT_FAILED, EXIT_OK, main
from gpuhedge_celery.config import parse_config
from gpuhedge_celery.providers.account_checks import CEREBRIUM_NO_SPEND
from gpuhedge_celery.store.budget import BudgetStore
from tests.support.cerebrium_fake import KEY, FakeCerebrium, cerebrium_block

pytestmark = pytest.mark.timeout(60)
WRONG = "cb-wrong-key-000-also-secret"
APP = "GET /v2/projects/p-test/apps/p-test-tts"


@pytest.fixture(scope="module")
def fake_process():
    with FakeCerebrium() as fake:
        yield fake


@pytest.fixture
def fake(fake_process):
    fake_process.reset()
    return fake_process


def config(fake, **overrides):
    return {
        "providers": {"cb": {"adapter": "cerebrium", "billed_rate_per_s": 0.001,
                             "cerebrium": cerebrium_block(fake, **overrides)}},
        "budget": {"ceiling_usd": 100},
    }  # fmt: skip


@pytest.fixture
def cli(fake, monkeypatch, tmp_path, redis_url, prefix):
    """``run(capsys, *args, **block overrides) -> (exit code, stdout)`` on a config with one
    cerebrium provider on the fake; no key, right or wrong, may appear in the output."""
    monkeypatch.setenv("CEREBRIUM_TEST_KEY", KEY)
    monkeypatch.delenv("GPUHEDGE_CONFIG", raising=False)
    path = tmp_path / "cb.yaml"

    def run(capsys, *args, **overrides):
        path.write_text(yaml.safe_dump(config(fake, **overrides)))
        code = main(["--redis-url", redis_url, "--prefix", prefix, "--config", str(path), *args])
        out = capsys.readouterr()
        assert KEY not in out.out + out.err and WRONG not in out.out + out.err, args
        return code, out.out

    return run


def test_login_check_reads_the_app_and_nothing_else(fake, cli, capsys):
    code, out = cli(capsys, "login-check", "--json")
    [row] = json.loads(out)
    assert code == EXIT_OK, row
    assert row == {"provider": "cb", "status": "ok", "identity": "p-test/p-test-tts",
                   "detail": f"{APP}: HTTP 200: app found (status ready)"}  # fmt: skip
    # one authenticated GET: nothing submitted, nothing cancelled
    assert fake.stats()["routes"] == {"app": 1}


def test_a_refused_key_is_one_failed_line_naming_the_provider(fake, cli, capsys, monkeypatch):
    monkeypatch.setenv("CEREBRIUM_TEST_KEY", WRONG)
    code, out = cli(capsys, "login-check")
    [line] = out.splitlines()[1:]
    assert code == EXIT_FAILED
    assert line.split()[:3] == ["cb", "failed", "p-test/p-test-tts"]
    assert line.endswith(f"{APP}: HTTP 401: key refused")


def test_an_app_cancels_cannot_reach_fails_the_check(fake, cli, capsys):
    code, out = cli(capsys, "login-check", "--json", app_id="p-test-gone")
    [row] = json.loads(out)
    assert code == EXIT_FAILED and row["status"] == "failed"
    assert "HTTP 404: no app 'p-test-gone' in project 'p-test'" in row["detail"]


def test_an_error_that_repeats_the_key_is_scrubbed_by_the_adapter_itself(fake, cli, capsys):
    fake.configure(faults={"app": {"errors_next": 2, "error_code": 500,
                                   "error_message": f"bad token {KEY}"}})  # fmt: skip
    provider = parse_config(config(fake), source="cb.yaml").build(
        "cb", env={"CEREBRIUM_TEST_KEY": KEY}
    )
    check = provider.login_check()
    assert check.status == "failed" and KEY not in check.detail
    assert "HTTP 500" in check.detail and "bad token <redacted>" in check.detail
    code, out = cli(capsys, "login-check")  # and through the command
    assert code == EXIT_FAILED and "bad token <redacted>" in out


def test_costs_is_unavailable_asks_nothing_and_records_nothing(
    fake, cli, capsys, redis_client, prefix
):
    code, out = cli(capsys, "costs", "--json")
    [row] = json.loads(out)
    assert code == EXIT_OK
    assert (row["provider"], row["status"], row["reported_usd"]) == ("cb", "unavailable", None)
    assert row["detail"] == CEREBRIUM_NO_SPEND and row["difference_usd"] is None
    assert fake.stats()["routes"] == {}
    assert [e for _, e in BudgetStore(redis_client, prefix).entries()] == []
