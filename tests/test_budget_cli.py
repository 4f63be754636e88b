"""The commands that guard real money, against real Redis and the loopback stand-ins.

Providers: a sim, an ``http`` provider on the RunPod-shaped test server (its key from the
environment), a second one whose key is written in the file (and wrong), a Modal function on
the Modal stand-in (tokens in the environment; its billing report is a knob) and a GPU pool
with no GPU. Every command's output is checked for every secret.
"""

from __future__ import annotations

import calendar
import json
import time

import pytest

from gpuhedge_celery.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from gpuhedge_celery.core.attempts import Attempt, Phase
from gpuhedge_celery.core.budget import to_nano, utc_day
from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.race.budget import RaceBudget
from gpuhedge_celery.store.budget import BudgetStore
from tests.support.http_provider_server import HttpProviderServer
from tests.support.modal_fake import FakeModalServer

RP_KEY = "rp-secret-key-123"
LITERAL = "literal-secret-789"
MODAL_ID, MODAL_SECRET = "ak-modal-id-123", "as-modal-secret-456"
SECRETS = (RP_KEY, LITERAL, MODAL_ID, MODAL_SECRET)
HTTP_CALLS = """submit: {url: /run, body: {input: "{request}"}, job_id: id}
      status: {url: "/status/{job_id}", state: status, payload: output.audio_base64}
      cancel: {url: "/cancel/{job_id}"}"""
CONFIG = f"""
providers:
  s: {{adapter: sim, role: primary, billed_rate_per_s: 0.0003}}
  rp:
    role: hedge
    adapter: http
    billed_rate_per_s: 0.0003
    idle_billed_seconds: 60
    http:
      base_url: "${{RP_BASE}}/v2/ep1"
      headers: {{authorization: "${{RP_KEY}}"}}
      {HTTP_CALLS}
  rp-literal:
    role: hedge
    adapter: http
    deployed: false
    http:
      base_url: "${{RP_BASE}}/v2/ep1"
      headers: {{authorization: "{LITERAL}"}}
      {HTTP_CALLS}
  m:
    role: fallback
    adapter: modal
    billed_rate_per_s: 0.000704
    modal:
      app: tts
      function: synthesize
      sdk: "tests.support.modal_fake_sdk:FakeModalClient"
      sdk_options: {{url: "${{MODAL_FAKE_URL}}"}}
  gpus:
    role: fallback
    adapter: pool
    deployed: false
    pool: {{name: nopool}}
budget:
  max_usd_per_request: 0.5
  max_usd_per_day: 10
  ceiling_usd: 100
  providers: {{m: {{max_usd_per_day: 3}}}}
  keys: {{tenant-a: {{max_usd_per_day: 1}}}}
  default_key: tenant-a
"""
YESTERDAY = utc_day(time.time() - 86400)


@pytest.fixture
def env(monkeypatch, tmp_path, redis_url, prefix):
    with HttpProviderServer() as http, FakeModalServer() as modal:
        http.knobs.api_key = RP_KEY
        modal.knobs.token_id, modal.knobs.token_secret = MODAL_ID, MODAL_SECRET
        modal.knobs.echo_token_in_errors = True  # an auth error repeats the token: scrubbed
        modal.knobs.billing = [
            {"description": "tts", "environment_name": "main",
             "interval_start": f"{YESTERDAY}T00:00:00+00:00", "cost": "0.5"},
            {"description": "another-app", "environment_name": "main",
             "interval_start": f"{YESTERDAY}T00:00:00+00:00", "cost": "9"},
        ]  # fmt: skip
        for name, value in (("RP_BASE", http.url), ("RP_KEY", RP_KEY),
                            ("MODAL_FAKE_URL", modal.url), ("MODAL_TOKEN_ID", MODAL_ID),
                            ("MODAL_TOKEN_SECRET", MODAL_SECRET)):  # fmt: skip
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("GPUHEDGE_CONFIG", raising=False)
        path = tmp_path / "money.yaml"
        path.write_text(CONFIG)
        yield {"path": path, "http": http, "modal": modal, "url": redis_url, "prefix": prefix}


def run(env, capsys, *args):
    code = main(["--redis-url", env["url"], "--prefix", env["prefix"],
                 "--config", str(env["path"]), *args])  # fmt: skip
    out = capsys.readouterr()
    for secret in SECRETS:
        assert secret not in out.out + out.err, (args, secret)
    return code, out.out, out.err


def spend_yesterday(env, redis_client, usd):
    """A settled race of provider m yesterday, as the workers would have left it."""
    noon = calendar.timegm(time.strptime(YESTERDAY, "%Y-%m-%d")) + 43200
    budget = RaceBudget(BudgetStore(redis_client, env["prefix"]),
                        _caps(env), VirtualClock(noon))  # fmt: skip
    state = {"spec": {"caps_s": {"m": 650.0}, "rates": {"m": {"rate_per_s": 0.000704,
             "idle_s": 0.0}}, "budget_key": "tenant-a"}}  # fmt: skip
    a = Attempt("a1", "m", "fallback", 0.0, phase=Phase.ENDED)
    assert budget.store.reserve(budget.reservation("r-yesterday", a, state)).granted
    budget.store.settle("r-yesterday", [("a1", to_nano(usd), "reconciled")], noon * 1000)


def _caps(env):
    from gpuhedge_celery.config import load_config

    return load_config(env["path"]).budget


def test_cerebrium_and_generic_http_report_no_spend():
    from gpuhedge_celery.config import parse_config

    block = {"base_url": "https://api.aws.us-east-1.cerebrium.ai/v4/p-1/tts",
             "submit": {"url": "/run", "job_id": "run_id"},
             "status": {"url": "/runs/{job_id}", "state": "status"},
             "cancel": {"url": "/runs/{job_id}"}}  # fmt: skip
    cfg = parse_config({"providers": {"cb": {"adapter": "http", "http": block}},
                        "budget": {"ceiling_usd": 1}})  # fmt: skip
    report = cfg.build("cb", env={}).reported_spend(0.0)
    assert (report.status, report.usd) == ("unavailable", None)
    assert report.detail == "Cerebrium has no account-spend API: unavailable"


def test_login_check_makes_one_read_per_provider_and_fails_unless_all_ok(env, capsys):
    code, out, _ = run(env, capsys, "login-check", "--json")
    rows = {r["provider"]: r for r in json.loads(out)}
    assert code == EXIT_FAILED
    assert {n: r["status"] for n, r in rows.items()} == {
        "s": "ok", "rp": "ok", "rp-literal": "failed", "m": "ok", "gpus": "failed",
    }  # fmt: skip
    assert "HTTP 401: key refused" in rows["rp-literal"]["detail"]
    assert rows["rp"]["identity"] == "127.0.0.1" and "key accepted" in rows["rp"]["detail"]
    assert rows["m"]["identity"] == "tts/synthesize" and "function found" in rows["m"]["detail"]
    assert "unknown pool 'nopool'" in rows["gpus"]["detail"]
    # the status probe was a GET (read-only): nothing was submitted or cancelled
    assert env["http"].ops("run") == [] and env["http"].ops("cancel") == []
    # a wrong Modal secret: failed, and the error that echoes the token shows no token
    env["modal"].knobs.token_secret = "another-secret"
    code, out, _ = run(env, capsys, "login-check")
    line = next(x for x in out.splitlines() if x.startswith("m "))
    assert code == EXIT_FAILED and " failed " in line and "AuthError" in line
    # only providers that pass: exit 0
    env["modal"].knobs.token_secret = MODAL_SECRET
    text = env["path"].read_text()
    head, _, _ = text.partition("  rp-literal:")
    rest = text.split("  m:", 1)[1].split("  gpus:", 1)[0]
    env["path"].write_text(head + "  m:" + rest + text[text.index("budget:") :])
    code, out, _ = run(env, capsys, "login-check")
    assert code == EXIT_OK, out
    assert [x.split()[1] for x in out.splitlines()[1:]] == ["ok", "ok", "ok"]


def test_costs_puts_each_providers_bill_beside_the_ledger_and_records_it(env, capsys, redis_client):
    spend_yesterday(env, redis_client, 0.42)
    code, out, _ = run(env, capsys, "costs", "--since", YESTERDAY, "--json")
    assert code == EXIT_OK
    rows = {r["provider"]: r for r in json.loads(out)}
    m = rows["m"]
    assert m["status"] == "ok" and m["from"] == m["through"] == YESTERDAY  # whole days only
    assert (m["reported_usd"], m["ledger_usd"], m["difference_usd"]) == (0.5, 0.42, 0.08)
    assert rows["rp"]["status"] == "unavailable" and "no billing API" in rows["rp"]["detail"]
    assert rows["s"]["detail"] == "simulated: nothing billed"
    assert rows["gpus"]["detail"].startswith("self-hosted GPUs")
    ledger = BudgetStore(redis_client, env["prefix"])
    records = [e for _, e in ledger.entries() if e["type"] == "reconcile"]
    assert len(records) == 1 and records[0]["provider"] == "m"
    assert int(records[0]["diff_nano"]) == to_nano(0.08) and m["record"]
    code, out, _ = run(env, capsys, "costs", "--since", YESTERDAY, "--no-record")
    assert code == EXIT_OK and "$0.0800" in out and "$0.4200" in out
    assert len([1 for _, e in ledger.entries() if e["type"] == "reconcile"]) == 1
    code, _, err = run(env, capsys, "costs", "--since", "last week")
    assert code == EXIT_USAGE and "--since" in err and len(err.strip().splitlines()) == 1


def test_budget_shows_caps_reserved_spent_and_headroom(env, capsys, redis_client):
    spend_yesterday(env, redis_client, 0.42)
    today = utc_day()
    caps = _caps(env)
    budget = RaceBudget(BudgetStore(redis_client, env["prefix"]), caps)
    state = {"spec": {"caps_s": {"rp": 100.0}, "rates": {"rp": {"rate_per_s": 0.001,
             "idle_s": 0.0}}, "budget_key": "tenant-a"}}  # fmt: skip
    budget.store.reserve(budget.reservation("r-now", Attempt("a1", "rp", "hedge", 0.0), state))
    code, out, _ = run(env, capsys, "budget", "--json")
    report = json.loads(out)
    rows = {r["scope"]: r for r in report["rows"]}
    assert code == EXIT_OK and report["enabled"] and report["open_reservations"] == 1
    assert rows[f"d:{today}"]["reserved_usd"] == 0.1 and rows[f"d:{today}"]["cap_usd"] == 10
    assert rows["all"]["spent_usd"] == 0.42 and rows["all"]["headroom_usd"] == 99.48
    assert rows[f"d:{today}:k:tenant-a"]["headroom_usd"] == 0.9
    assert rows[f"d:{today}:p:m"]["cap_usd"] == 3 and rows["p:rp"]["cap_usd"] is None
    code, out, _ = run(env, capsys, "budget")
    assert code == EXIT_OK and "lifetime ceiling" in out and "$99.4800" in out


def test_ledger_export_writes_jsonl(env, capsys, redis_client, tmp_path):
    spend_yesterday(env, redis_client, 0.42)
    code, out, _ = run(env, capsys, "ledger", "export")
    lines = [json.loads(x) for x in out.splitlines()]
    assert code == EXIT_OK and [x["type"] for x in lines] == ["reserve", "settle"]
    assert lines[1]["usd"] == 0.42 and lines[1]["reserved_usd"] == 0.4576  # 650 s at $0.000704
    assert lines[1]["nano"] == to_nano(0.42) and lines[0]["key"] == "tenant-a"
    code, out, _ = run(env, capsys, "ledger", "export", "--since", "2999-01-01")
    assert code == EXIT_OK and out == ""
    assert lines[0]["reservation"] == lines[1]["reservation"] == "r-yesterday/a1"
    since = lines[1]["stream_id"]
    code, out, _ = run(env, capsys, "ledger", "export", "--since", since)
    assert [json.loads(x)["type"] for x in out.splitlines()] == ["settle"]
    target = tmp_path / "ledger.jsonl"
    code, _, err = run(env, capsys, "ledger", "export", "-o", str(target))
    assert code == EXIT_OK and len(target.read_text().splitlines()) == 2 and "2 ledger" in err
    code, _, err = run(env, capsys, "ledger", "export", "--since", "yesterday-ish")
    assert code == EXIT_USAGE and len(err.strip().splitlines()) == 1


def test_plan_config_show_and_the_go_gate(env, capsys, redis_client):
    traces = "tests/data/moss_rounds.jsonl"
    code, out, _ = run(env, capsys, "plan", traces, "--map", "s=runpod", "--map", "rp=modal",
                       "--json")  # fmt: skip
    plan = json.loads(out)
    assert code == EXIT_OK and plan["policy"] == "hedge:s->rp@10s"
    cost = plan["replay"]["cost_per_request_usd"]
    assert 0 < cost["mean"] <= cost["p95"] <= cost["max"] and plan["replay"]["rounds"] == 54
    worst = {r["provider"]: r["worst_case_usd"] for r in plan["providers"]}
    assert worst["rp"] == pytest.approx((180 + 60) * 0.0003)
    assert plan["worst_case_per_request_usd"] == pytest.approx(worst["s"] + worst["rp"])
    code, _, err = run(env, capsys, "plan", traces)
    assert code == EXIT_USAGE and "provider 's' is not in the traces" in err
    code, out, _ = run(env, capsys, "config", "check")
    assert code == EXIT_OK and out.startswith("ok: ")
    code, out, _ = run(env, capsys, "config", "show")
    shown = json.loads(out)
    assert code == EXIT_OK and shown["budget"]["ceiling_usd"] == 100
    assert shown["providers"]["rp"]["http"]["headers"]["authorization"] == "<redacted>"
    assert shown["providers"]["rp"]["http"]["base_url"] == "${RP_BASE}/v2/ep1"  # not expanded
    # race without --go: what it would do and its worst case, nothing sent, exit 2
    code, out, err = run(env, capsys, "race", '{"text": "hi"}', "--budget-key", "tenant-a")
    assert code == EXIT_USAGE and "worst-case spend: $" in out and "add --go" in err
    assert "rp: worst case $0.0720" in out
    assert not [k for k in redis_client.scan_iter(f"{env['prefix']}:*")]  # nothing was sent
    code, _, err = run(env, capsys, "race", '{"text": "hi"}', "--budget-key", "tenant-b")
    assert code == EXIT_USAGE and "budget_key: no budget for key 'tenant-b'" in err


def test_ledger_repair_rebuilds_the_counters_from_the_ledger(env, capsys, redis_client):
    spend_yesterday(env, redis_client, 0.42)
    code, out, _ = run(env, capsys, "ledger", "repair")
    assert code == EXIT_OK and out.startswith("ok:")
    ledger = BudgetStore(redis_client, env["prefix"])
    good = ledger.totals()
    # a settlement that failed after its first write, as budget_settle once could: the lifetime
    # reserved counter lowered with no ledger entry to show for it
    redis_client.hincrby(ledger.keys.totals, "r|all", -to_nano(0.3))
    redis_client.hset(ledger.keys.totals, "s|bogus", 5)
    code, out, _ = run(env, capsys, "ledger", "repair", "--json")
    found = json.loads(out)
    assert code == EXIT_FAILED and not found["applied"]
    assert found["differences"] == {"r|all": [-to_nano(0.3), 0], "s|bogus": [5, 0]}
    assert ledger.totals() != good  # only compared
    code, out, _ = run(env, capsys, "ledger", "repair", "--apply")
    assert code == EXIT_OK and "2 budget counter(s) repaired" in out
    assert ledger.totals() == good
    code, out, _ = run(env, capsys, "ledger", "repair")
    assert code == EXIT_OK and out.startswith("ok:")


def test_ledger_repair_refuses_a_trimmed_ledger(env, capsys, redis_client):
    spend_yesterday(env, redis_client, 0.42)
    ledger = BudgetStore(redis_client, env["prefix"])
    redis_client.xtrim(ledger.keys.ledger, maxlen=1, approximate=False)  # the reserve is gone
    before = ledger.totals()
    code, _, err = run(env, capsys, "ledger", "repair", "--apply")
    assert code == EXIT_FAILED and "the ledger was trimmed (1 of 2 entries left)" in err
    assert ledger.totals() == before


def test_ledger_repair_refuses_when_the_ledger_is_gone_but_counters_remain(
    env, capsys, redis_client
):
    spend_yesterday(env, redis_client, 0.42)
    ledger = BudgetStore(redis_client, env["prefix"])
    redis_client.delete(ledger.keys.ledger)
    before = ledger.totals()
    code, _, err = run(env, capsys, "ledger", "repair", "--apply")
    assert code == EXIT_FAILED and "the ledger stream is gone" in err
    assert ledger.totals() == before and before
