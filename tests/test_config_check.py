"""``gpuhedge-celery config check [FILE]`` and the global ``--config``: a config is read when
named, a missing or broken one is one line and exit code 2, never a silent fallback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from gpuhedge_celery.cli import EXIT_OK, EXIT_REDIS, EXIT_USAGE, cli, main
from gpuhedge_celery.config import packaged_path
from tests.support.fresh_imports import clean_env

VALID = packaged_path("default.yaml").read_text()
DEAD_REDIS = "redis://127.0.0.1:1/0"  # nothing listens on port 1
BROKEN = [
    ("providers: {\n  x: [\n", "invalid YAML at line 3, column 1"),
    (VALID + "polcy: {name: fixed}\n", "polcy: unknown key; did you mean 'policy'?"),
    (VALID.replace("billed_rate_per_s: 0.000306", "billed_rate_per_s: cheap"),
     "providers.sim-cheap.billed_rate_per_s: expected a number >= 0, got 'cheap'"),
]  # fmt: skip


@pytest.fixture(autouse=True)
def _no_config_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("GPUHEDGE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)  # no ./config/gpuhedge.yaml unless a test writes one


def write(tmp_path, name, text):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def one_error_line(capsys):
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert captured.out == ""
    return lines[0]


def test_check_of_a_valid_file_prints_one_ok_line(tmp_path):
    path = write(tmp_path, "mine.yaml", VALID)
    out = CliRunner().invoke(cli, ["config", "check", str(path)])
    assert out.exit_code == EXIT_OK, out.output
    (line,) = out.output.splitlines()
    assert line.startswith(f"ok: {path}: ")
    assert "sim-cheap (primary)" in line and "policy fixed" in line and "validator wav" in line


@pytest.mark.parametrize(("text", "expected"), BROKEN)
def test_check_of_a_broken_file_is_one_line_and_exit_2(tmp_path, capsys, text, expected):
    path = write(tmp_path, "broken.yaml", text)
    assert main(["config", "check", str(path)]) == EXIT_USAGE
    line = one_error_line(capsys)
    assert line.startswith(f"error: {path}: ") and expected in line


def test_check_of_a_missing_file_says_so(tmp_path, capsys):
    assert main(["config", "check", str(tmp_path / "nope.yaml")]) == EXIT_USAGE
    assert one_error_line(capsys) == f"error: {tmp_path / 'nope.yaml'}: config file not found"


def test_check_without_a_file_checks_the_config_in_use(tmp_path, monkeypatch):
    runner = CliRunner()
    out = runner.invoke(cli, ["config", "check"])  # nothing here: the packaged default
    assert out.exit_code == EXIT_OK and f"ok: {packaged_path('default.yaml')}:" in out.output

    local = write(tmp_path, "config/gpuhedge.yaml", VALID)
    out = runner.invoke(cli, ["config", "check"])
    assert out.exit_code == EXIT_OK and out.output.startswith(f"ok: {local}:")

    named = write(tmp_path, "named.yaml", VALID)
    out = runner.invoke(cli, ["--config", str(named), "config", "check"])
    assert out.exit_code == EXIT_OK and out.output.startswith(f"ok: {named}:")
    monkeypatch.setenv("GPUHEDGE_CONFIG", str(named))
    out = runner.invoke(cli, ["config", "check"])
    assert out.exit_code == EXIT_OK and out.output.startswith(f"ok: {named}:")


def test_check_without_a_file_reports_the_named_config_broken(tmp_path, capsys, monkeypatch):
    write(tmp_path, "config/gpuhedge.yaml", VALID)  # present, but not the one named
    broken = write(tmp_path, "broken.yaml", BROKEN[1][0])
    assert main(["--config", str(broken), "config", "check"]) == EXIT_USAGE
    assert BROKEN[1][1] in one_error_line(capsys)
    monkeypatch.setenv("GPUHEDGE_CONFIG", str(tmp_path / "gone.yaml"))
    assert main(["config", "check"]) == EXIT_USAGE
    assert "gone.yaml: config file not found (from --config or GPUHEDGE_CONFIG)" in (
        one_error_line(capsys)
    )


def test_a_file_given_to_check_wins_over_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUHEDGE_CONFIG", str(tmp_path / "gone.yaml"))
    path = write(tmp_path, "mine.yaml", VALID)
    out = CliRunner().invoke(cli, ["config", "check", str(path)])
    assert out.exit_code == EXIT_OK and out.output.startswith(f"ok: {path}:")


@pytest.mark.parametrize("how", ["option", "env"])
def test_a_missing_explicit_config_stops_every_command_before_it_runs(
    tmp_path, capsys, monkeypatch, how
):
    missing = tmp_path / "nope.yaml"
    args = ["--redis-url", DEAD_REDIS]
    if how == "option":
        args += ["--config", str(missing)]
    else:
        monkeypatch.setenv("GPUHEDGE_CONFIG", str(missing))
    for command in (["leases"], ["watch", "--once"], ["receipt", "r1"]):
        # exit 2 for the config, not 3 for the dead Redis: it is checked first
        assert main([*args, *command]) == EXIT_USAGE, command
        line = one_error_line(capsys)
        assert line == f"error: {missing}: config file not found (from --config or GPUHEDGE_CONFIG)"


@pytest.mark.parametrize(("text", "expected"), BROKEN)
def test_a_malformed_explicit_config_stops_an_ordinary_command(tmp_path, capsys, text, expected):
    write(tmp_path, "config/gpuhedge.yaml", VALID)  # a valid one to fall back to: not taken
    broken = write(tmp_path, "broken.yaml", text)
    # exit 2 for the config, not 3 for the dead Redis: the config is read first
    assert main(["--redis-url", DEAD_REDIS, "--config", str(broken), "budget"]) == EXIT_USAGE
    line = one_error_line(capsys)
    assert line.startswith(f"error: {broken}: ") and expected in line, line


def test_an_existing_explicit_config_lets_the_command_run(tmp_path, capsys):
    path = write(tmp_path, "mine.yaml", VALID)
    assert main(["--redis-url", DEAD_REDIS, "--config", str(path), "leases"]) == EXIT_REDIS
    assert one_error_line(capsys).startswith(f"error: Redis at {DEAD_REDIS} is unreachable")


def run_module(*args, cwd):
    env = clean_env()  # this checkout first on PYTHONPATH, no GPUHEDGE_* from outside
    return subprocess.run(
        [sys.executable, "-m", "gpuhedge_celery", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(cwd),
        env=env,
    )


def test_the_installed_entry_point_checks_a_config(tmp_path):
    good = write(tmp_path, "good.yaml", VALID)
    done = run_module("config", "check", str(good), cwd=tmp_path)
    assert done.returncode == EXIT_OK, done.stderr
    assert done.stdout.startswith(f"ok: {good}:") and len(done.stdout.splitlines()) == 1

    bad = write(tmp_path, "bad.yaml", BROKEN[1][0])
    done = run_module("config", "check", str(bad), cwd=tmp_path)
    assert done.returncode == EXIT_USAGE
    assert done.stdout == ""
    assert done.stderr.strip() == f"error: {bad}: {BROKEN[1][1]}"
