"""A config without providers (an empty file, a config map mounted empty, a file holding only
``validator: wav``) is refused: ``config check`` exits 2 with one line naming the file, and a
coordination worker refuses to start with that line (a real ``celery worker`` process)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gpuhedge_celery.cli import EXIT_USAGE, cli, main

EMPTY = ["", "validator: wav\n", "# only a comment\n", "providers: {}\n"]
REASON = "providers: empty: expected at least one provider with role: primary"


@pytest.fixture(autouse=True)
def _no_config_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("GPUHEDGE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("text", EMPTY)
def test_config_check_refuses_a_config_without_providers(tmp_path, capsys, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert main(["config", "check", str(path)]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"error: {path}: {REASON}"]


def test_every_command_that_reads_it_refuses_it(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    for command in (["plan"], ["config", "show"]):
        out = CliRunner().invoke(cli, ["--config", str(path), *command])
        assert out.exit_code != 0 and f"{path}: {REASON}" in str(out.exception), command


@pytest.mark.redis
@pytest.mark.celery
@pytest.mark.parametrize("text", ["", "validator: wav\n"], ids=["empty", "validator-only"])
def test_a_coordination_worker_refuses_a_config_without_providers(celery_cluster, tmp_path, text):
    path = tmp_path / "mounted.yaml"
    path.write_text(text)
    worker = celery_cluster.start_coordinator(wait=False, GPUHEDGE_CONFIG=str(path))
    code = worker.process.wait(60)
    log = worker.log()
    assert code == 2 and " ready." not in log, log[-3000:]
    assert log.strip().splitlines()[-1] == f"error: {path}: {REASON}"
