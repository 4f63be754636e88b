"""A budget cap that refuses an attempt the policy can launch: found by a pure function, said by
``config check`` (ok with warnings, exit 0; --strict exits 1) and ``plan`` (the unclamped worst
case and a ``warnings`` list), and absent from every config shipped in config/ and the package."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuhedge_celery.cli import EXIT_FAILED, EXIT_OK, cli
from gpuhedge_celery.config import (
    cap_warnings,
    load_config,
    packaged_path,
    parse_config_text,
    planned_attempts,
)
from gpuhedge_celery.core.budget import BudgetCaps, PlannedAttempt, ScopeCap, cap_conflicts

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(ROOT.glob("config/*.yaml")) + [
    packaged_path("default.yaml"),
    packaged_path("demo.yaml"),
]

# The cerebrium preset's attempts (provider seconds): a 180 s primary with a 60 s idle window,
# a 120 s hedge with a 5 s one, both at $0.000306/s.
P = PlannedAttempt("runpod", "primary", 180, 0.000306, 60)
H = PlannedAttempt("cerebrium", "hedge", 120, 0.000306, 5)
F = PlannedAttempt("reserve", "fallback", 60, 0.0011, 0)
BOTH = P.worst_case_usd + H.worst_case_usd
ALL3 = BOTH + F.worst_case_usd


def found(caps, attempts):
    return [
        (c.cap, c.attempt.role, tuple(b.role for b in c.before))
        for c in cap_conflicts(caps, attempts)
    ]


@pytest.mark.parametrize(
    ("caps", "attempts", "expected"),
    [
        (BudgetCaps(), [P, H], []),
        (BudgetCaps(max_usd_per_request=0.10), [P, H],
         [("max_usd_per_request", "hedge", ("primary",))]),
        (BudgetCaps(max_usd_per_request=BOTH + 1e-9), [P, H], []),  # equal to the sum fits
        (BudgetCaps(max_usd_per_request=BOTH - 1e-6), [P, H],
         [("max_usd_per_request", "hedge", ("primary",))]),
        (BudgetCaps(max_usd_per_request=0.10), [P], []),  # single: the primary alone fits
        # a ceiling below the primary's own worst case: refused every time; the hedge, which
        # reserves beside nothing then, still fits
        (BudgetCaps(ceiling_usd=(P.worst_case_usd + H.worst_case_usd) / 2), [P, H],
         [("ceiling_usd", "primary", ())]),
        (BudgetCaps(max_usd_per_day=0.05), [P, H], [("max_usd_per_day", "primary", ())]),
        (BudgetCaps(max_usd_per_day=0.08), [P, H], [("max_usd_per_day", "hedge", ("primary",))]),
        # a provider's cap counts only that provider's attempts
        (BudgetCaps(ceiling_usd=1, providers={"cerebrium": ScopeCap(max_usd_per_day=0.02)}),
         [P, H], [("providers.cerebrium.max_usd_per_day", "hedge", ())]),
        (BudgetCaps(ceiling_usd=1, providers={"cerebrium": ScopeCap(max_usd_total=0.05)}),
         [P, H], []),
        # a key's cap counts every attempt of a request with that key
        (BudgetCaps(keys={"tenant-a": ScopeCap(max_usd_per_day=0.1)}), [P, H],
         [("keys.tenant-a.max_usd_per_day", "hedge", ("primary",))]),
        (BudgetCaps(keys={"small": ScopeCap(max_usd_total=0.1), "big": ScopeCap(max_usd_total=1)},
                    default_key="big"),
         [P, H], [("keys.small.max_usd_total", "hedge", ("primary",))]),
        # a cascade: primary and hedge fit, the fallback beside them does not
        (BudgetCaps(max_usd_per_request=BOTH + 0.01), [P, H, F],
         [("max_usd_per_request", "fallback", ("primary", "hedge"))]),
        (BudgetCaps(max_usd_per_request=ALL3), [P, H, F], []),
        # two caps, two warnings
        (BudgetCaps(max_usd_per_request=0.1, max_usd_per_day=0.1), [P, H],
         [("max_usd_per_request", "hedge", ("primary",)),
          ("max_usd_per_day", "hedge", ("primary",))]),
    ],
)  # fmt: skip
def test_which_attempts_a_cap_forbids(caps, attempts, expected):
    assert found(caps, attempts) == expected


def test_the_warning_carries_the_arithmetic():
    (conflict,) = cap_conflicts(BudgetCaps(max_usd_per_request=0.10), [P, H])
    text = conflict.text()
    assert text.startswith("budget.max_usd_per_request $0.1 forbids the hedge attempt (cerebrium)")
    primary = "primary runpod 180 s x $0.000306/s + 60 s idle x $0.000306/s"
    hedge = "hedge cerebrium 120 s x $0.000306/s + 5 s idle x $0.000306/s"
    assert f"{primary} = ${P.worst_case_usd:.4f}, {hedge} = ${H.worst_case_usd:.4f};" in text
    assert f"together ${BOTH:.4f} > $0.1" in text and "\n" not in text
    (alone,) = cap_conflicts(BudgetCaps(ceiling_usd=0.05), [P])
    assert alone.text().endswith(f"= ${P.worst_case_usd:.4f} > $0.05; it is refused every time")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_no_shipped_config_has_a_cap_that_forbids_its_policys_attempts(path):
    cfg = load_config(path)
    assert [w.text() for w in cap_warnings(cfg)] == []
    out = CliRunner().invoke(cli, ["config", "check", str(path)])
    assert out.exit_code == EXIT_OK and out.output.startswith(f"ok: {path}:"), out.output


def old_cerebrium(tmp_path) -> Path:
    """config/cerebrium.yaml with the per-request cap it once had: $0.10."""
    text = (ROOT / "config" / "cerebrium.yaml").read_text()
    cap = load_config(ROOT / "config" / "cerebrium.yaml").budget.max_usd_per_request
    old = text.replace(f"max_usd_per_request: {cap:g}", "max_usd_per_request: 0.10")
    assert old != text
    path = tmp_path / "cerebrium-old.yaml"
    path.write_text(old)
    return path


def test_the_attempts_are_the_policys_with_roles_and_caps():
    cfg = load_config(ROOT / "config" / "cerebrium.yaml")
    assert planned_attempts(cfg) == [
        PlannedAttempt("runpod", "primary", 180, 0.000306, 60),
        PlannedAttempt("cerebrium", "hedge", 120, 0.000306, 5),
    ]


def test_config_check_says_ok_with_warnings_and_strict_fails(tmp_path):
    path = old_cerebrium(tmp_path)
    out = CliRunner().invoke(cli, ["config", "check", str(path)])
    lines = out.output.splitlines()
    assert out.exit_code == EXIT_OK, out.output
    assert lines[0].startswith(f"ok with 1 warning: {path}: providers runpod (primary)")
    assert len(lines) == 2 and lines[1].startswith(
        "warning: budget.max_usd_per_request $0.1 forbids the hedge attempt (cerebrium): "
    )
    assert "together $0.1117 > $0.1" in lines[1]
    strict = CliRunner().invoke(cli, ["config", "check", "--strict", str(path)])
    assert strict.exit_code == EXIT_FAILED and strict.output == out.output


def test_plan_shows_the_unclamped_worst_case_and_the_warning(tmp_path):
    path = old_cerebrium(tmp_path)
    out = CliRunner().invoke(cli, ["--config", str(path), "plan", "--json"])
    assert out.exit_code == EXIT_OK, out.output
    plan = json.loads(out.output)
    assert plan["worst_case_per_request_usd"] == pytest.approx(BOTH)  # not clamped to $0.10
    (warning,) = plan["warnings"]
    assert warning.startswith("budget.max_usd_per_request $0.1 forbids the hedge attempt")
    text = CliRunner().invoke(cli, ["--config", str(path), "plan"]).output
    assert f"worst case per request: ${BOTH:,.4f}" in text
    assert "warnings (1)" in text and f"  {warning}" in text
    preset = str(ROOT / "config" / "cerebrium.yaml")
    fixed = CliRunner().invoke(cli, ["--config", preset, "plan", "--json"])
    assert json.loads(fixed.output)["warnings"] == []


def test_the_readme_configs_fit_their_caps():
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    configs = [b for b in blocks if "providers:" in b and "budget" in b]
    assert len(configs) >= 2  # the http example and the RunPod + Cerebrium hedge
    for text in configs:
        cfg = parse_config_text(text, source="README.md")
        assert [w.text() for w in cap_warnings(cfg)] == []


def test_the_race_dry_runs_lines_name_the_refused_hedge(tmp_path, monkeypatch, capsys):
    from gpuhedge_celery.cli import main

    for name in ("RUNPOD_ENDPOINT_ID", "RUNPOD_API_KEY", "CEREBRIUM_PROJECT_ID",
                 "CEREBRIUM_API_KEY"):  # fmt: skip
        monkeypatch.setenv(name, "x")
    code = main(["--config", str(old_cerebrium(tmp_path)), "race", '{"text": "hi"}'])
    out = capsys.readouterr().out
    assert code == 2  # a dry run: nothing is sent
    assert "warning: budget.max_usd_per_request $0.1 forbids the hedge attempt (cerebrium)" in out
    assert "worst-case spend: $0.1" in out  # what the reservations can reach at most
