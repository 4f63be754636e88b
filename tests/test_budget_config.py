"""The ``budget:`` block: every cap parsed, bad input one line naming file and key, and real money
(any provider but the simulator) refused without a hard ceiling."""

from __future__ import annotations

import pytest

from gpuhedge_celery.cli import EXIT_USAGE, main
from gpuhedge_celery.config import load_config, packaged_path, parse_config_text
from gpuhedge_celery.core.budget import BudgetCaps, ScopeCap
from gpuhedge_celery.errors import ConfigError

SIM = "providers:\n  p: {adapter: sim}\n  h: {adapter: sim, role: hedge}\n"
HTTP = """providers:
  rp:
    adapter: http
    http: {base_url: "https://x", submit: {url: /run, job_id: id},
           status: {url: "/s/{job_id}", state: status}, cancel: {url: "/c/{job_id}"}}
"""
POOL = "providers:\n  gpus: {adapter: pool, pool: {name: default}}\n"


def test_every_cap_is_parsed():
    cfg = parse_config_text(
        SIM
        + """budget:
  max_usd_per_request: 0.1
  max_usd_per_day: 20
  ceiling_usd: 400
  providers: {h: {max_usd_per_day: 5, max_usd_total: 50}}
  keys: {tenant-a: {max_usd_per_day: 2}, shared: {max_usd_total: 1}}
  default_key: shared
  unknown_keys: default
"""
    )
    assert cfg.budget == BudgetCaps(
        0.1, 20.0, 400.0, {"h": ScopeCap(5.0, 50.0)},
        {"tenant-a": ScopeCap(2.0, None), "shared": ScopeCap(None, 1.0)}, "shared", "default",
    )  # fmt: skip
    assert cfg.budget.enabled and cfg.budget_usd_per_request == 0.1
    assert not parse_config_text(SIM).budget.enabled  # no cap: budgets off


@pytest.mark.parametrize(
    "text, key, message",
    [
        (HTTP, "budget.ceiling_usd",
         "required: provider 'rp' (adapter http) spends real money; set a hard ceiling in USD"),
        (POOL, "budget.ceiling_usd", "required: provider 'gpus' (adapter pool) spends real money"),
        (HTTP + "budget: {max_usd_per_day: 5}\n", "budget.ceiling_usd", "required: provider"),
        (SIM + "budget: {ceiling_usd: -1}\n", "budget.ceiling_usd", "expected a number > 0"),
        (SIM + "budget: {ceiling_usd: lots}\n", "budget.ceiling_usd", "got 'lots'"),
        (SIM + "budget: {max_usd_per_request: 0}\n", "budget.max_usd_per_request",
         "expected a number > 0"),
        (SIM + "budget: {max_usd: 1}\n", "budget.max_usd", "unknown key"),
        (SIM + "budget: {ceiling: 1}\n", "budget.ceiling", "did you mean 'ceiling_usd'?"),
        (SIM + "budget: {max_usd_per_request: 5, ceiling_usd: 1}\n",
         "budget.max_usd_per_request", "$5 is above ceiling_usd $1"),
        (SIM + "budget: {providers: {x: {max_usd_per_day: 1}}}\n", "budget.providers.x",
         "no provider 'x' (known: p, h)"),
        (SIM + "budget: {providers: {p: {}}}\n", "budget.providers.p",
         "expected max_usd_per_day and/or max_usd_total"),
        (SIM + "budget: {keys: {a: {max_usd_per_day: 1}}}\n", "budget.default_key",
         "required with budget.keys: a request naming no key is charged to it"),
        (SIM + "budget: {keys: {a: {max_usd_per_day: 1}}, default_key: b}\n",
         "budget.default_key", "no key 'b' in budget.keys (known: a)"),
        (SIM + "budget: {keys: {a: {max_usd_per_day: 1}, '*': {max_usd_per_day: 1}}, "
         "default_key: a}\n", "budget.keys.*", "not accepted: it gives every unlisted key"),
        (SIM + "budget: {keys: {a: {max_usd_per_day: 1}}, default_key: a, unknown_keys: x}\n",
         "budget.unknown_keys", "expected one of refuse, default, got 'x'"),
        (SIM + "budget: {ceiling_usd: 1, unknown_keys: default}\n", "budget.unknown_keys",
         "'default' needs budget.default_key"),
        (SIM + "budget: {providers: {p: {per_day: 1}}}\n", "budget.providers.p.per_day",
         "unknown key"),
        (SIM + "budget: {keys: {'a b': {max_usd_per_day: 1}}}\n", "budget.keys.a b",
         "expected a budget key"),
        (SIM + "budget: {keys: [a]}\n", "budget.keys", "expected a mapping"),
    ],
)  # fmt: skip
def test_bad_budget_config_is_one_line_naming_file_and_key(tmp_path, capsys, text, key, message):
    with pytest.raises(ConfigError) as caught:
        parse_config_text(text, source="b.yaml")
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"b.yaml: {key}: ") and message in line, line
    # the command line says the same one line, exit code 2
    path = tmp_path / "b.yaml"
    path.write_text(text)
    assert main(["config", "check", str(path)]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"error: {path}: {key}: {line.split(': ', 2)[2]}"]


def test_shipped_configs_that_spend_money_all_have_a_ceiling():
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    for path in [*sorted((repo / "config").glob("*.yaml")), packaged_path("demo.yaml")]:
        cfg = load_config(path)
        assert cfg.budget.ceiling_usd is not None, path
    assert load_config(packaged_path("default.yaml")).budget.ceiling_usd is None  # sims only


def test_budget_keys_are_checked_when_a_race_is_asked_for():
    from gpuhedge_celery.race.spec import build_spec

    cfg = parse_config_text(
        SIM + "budget: {keys: {tenant-a: {max_usd_per_day: 1}, shared: {max_usd_per_day: 1}}, "
        "default_key: shared}\n"
    )
    assert build_spec(cfg, budget_key="tenant-a").budget_key == "tenant-a"
    assert build_spec(cfg).budget_key == "shared"  # naming no key skips no key cap
    with pytest.raises(ConfigError, match=r"^budget_key: no budget for key 'tenant-b'"):
        build_spec(cfg, budget_key="tenant-b")
    with pytest.raises(ConfigError, match=r"^budget_key: expected 1-100 letters"):
        build_spec(cfg, budget_key="*")
    # without per-key caps any key is taken (its spend is still counted per key)
    assert build_spec(parse_config_text(SIM), budget_key="anyone").budget_key == "anyone"
