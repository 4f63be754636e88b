"""`replay` and `bench replay` through click's runner and the installed console script."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from gpuhedge_celery.cli import cli

TRACES = str(pathlib.Path(__file__).parent / "data" / "moss_rounds.jsonl")
ROW_KEYS = {
    "policy",
    "subset",
    "n",
    "p50_s",
    "p95_s",
    "p95_linear_s",
    "max_s",
    "misses",
    "miss_ci",
    "active_usd",
    "billed_usd",
    "hedged",
    "hedge_rate",
}


def invoke(*args: str):
    return CliRunner().invoke(cli, ["replay", *args], catch_exceptions=False)


def test_default_text_report_has_provider_table_and_every_family():
    result = invoke(TRACES)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Per provider over 54 rounds" in out and "1.1-27.6 s" in out
    for subset in ("== all (n = 54)", "== calibration (n = 18)", "== evaluation (n = 36)"):
        assert subset in out
    for title in ("singles", "immediate races", "fixed hedges", "cutovers", "cascades"):
        assert out.count(title) == 3
    assert "cascade:runpod->cerebrium->modal@q2.5s+s8.5s+e25s" in out
    assert "hedge:modal->cerebrium@45s" in out


def test_json_rows_have_exactly_the_documented_keys():
    result = invoke(
        TRACES,
        "--subset",
        "evaluation",
        "--policy",
        "single:runpod",
        "--policy",
        "cutover:runpod->cerebrium@q2.5s+s8.5s",
        "--deadline",
        "30",
        "--deadline",
        "60",
        "--json",
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["policy"] for r in rows] == [
        "single:runpod",
        "cutover:runpod->cerebrium@q2.5s+s8.5s",
    ]
    for row in rows:
        assert set(row) == ROW_KEYS
        assert row["subset"] == "evaluation" and row["n"] == 36
        assert set(row["misses"]) == {"30", "60"} and set(row["miss_ci"]) == {"30", "60"}
        assert all(len(ci) == 2 and ci[0] <= ci[1] for ci in row["miss_ci"].values())
    assert rows[0]["misses"]["60"] == 11 and rows[0]["hedge_rate"] == 0.0
    assert round(rows[1]["p95_s"], 1) == 21.9 and round(rows[1]["hedge_rate"], 4) == 0.3056


def test_rate_override_changes_cost():
    result = invoke(
        TRACES,
        "--subset",
        "evaluation",
        "--policy",
        "single:modal",
        "--rate",
        "modal=0.001",
        "--json",
    )
    [row] = json.loads(result.output)
    assert row["active_usd"] == pytest.approx(0.0295 / 0.000704 * 0.001, rel=2e-3)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--policy", "hedge:runpod"], "bad policy name"),
        (["--policy", "single:lambda"], "no recorded provider 'lambda'"),
        (["--rate", "runpod"], "bad --rate"),
        (["--deadline", "-5"], "--deadline must be a positive"),
        (["--subset", "weekend"], "weekend"),
    ],
)
def test_bad_input_is_a_one_line_usage_error(args, fragment):
    result = CliRunner().invoke(cli, ["replay", TRACES, *args])
    assert result.exit_code == 2
    assert fragment in result.output


def test_unreadable_or_malformed_traces(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "round", "round_id": 1, "providers": {"a": {"valid": true}}}\n')
    result = CliRunner().invoke(cli, ["replay", str(bad)])
    assert result.exit_code == 2 and "bad.jsonl: line 1:" in result.output
    bad.write_text("{not json\n")
    result = CliRunner().invoke(cli, ["replay", str(bad)])
    assert result.exit_code == 2 and "not JSON" in result.output
    result = CliRunner().invoke(cli, ["replay", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 2 and "cannot read traces" in result.output


def test_plot_writes_a_png(tmp_path):
    import matplotlib  # noqa: F401  (in the test extra: this test must run, never skip)

    target = tmp_path / "cdf.png"
    result = invoke(TRACES, "--subset", "evaluation", "--plot", str(target))
    assert result.exit_code == 0, result.output
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert target.stat().st_size > 10_000


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes "import matplotlib" fail
    result = CliRunner().invoke(
        cli, ["replay", TRACES, "--policy", "single:runpod", "--plot", str(tmp_path / "x.png")]
    )
    assert result.exit_code == 2
    assert "--plot needs matplotlib" in result.output and "[plot]" in result.output
    assert not (tmp_path / "x.png").exists()


def test_installed_entry_point(tmp_path):
    exe = shutil.which("gpuhedge-celery")
    assert exe, "the gpuhedge-celery console script is not installed (pip install -e .)"
    ok = subprocess.run(
        [exe, "replay", TRACES, "--subset", "evaluation", "--policy", "single:runpod", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    [row] = json.loads(ok.stdout)
    assert round(row["p95_s"], 1) == 116.6
    bad = subprocess.run(
        [exe, "replay", TRACES, "--policy", "cascade:a->b"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "bad policy name" in bad.stderr


def test_bench_replay_prints_json():
    result = CliRunner().invoke(
        cli, ["bench", "replay", "--json", "--repeat", "1"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["bench"] == "replay"
    [res] = data["results"]
    assert res["rows"] == 165 and res["wall_s"] > 0 and res["peak_mem_mb"] > 0
