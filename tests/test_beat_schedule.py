"""Beat keeps its schedule file in a state directory (``GPUHEDGE_BEAT_SCHEDULE``), never in the
directory it was started from (real ``celery -A gpuhedge_celery beat`` processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuhedge_celery.settings import Settings
from gpuhedge_celery.tasks.app import BEAT_SCHEDULER, celery_conf
from gpuhedge_celery.tasks.config import GlueConfig, default_schedule
from tests.support.fixtures_celery import CeleryWorker
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]


def test_the_schedule_file_defaults_to_the_state_directory():
    env = {"XDG_STATE_HOME": "/state", "HOME": "/home/u", "GPUHEDGE_PREFIX": "app1"}
    assert default_schedule(env, "app1") == "/state/gpuhedge-celery/celerybeat-schedule-app1"
    del env["XDG_STATE_HOME"]
    assert default_schedule(env, "app1") == (
        "/home/u/.local/state/gpuhedge-celery/celerybeat-schedule-app1"
    )
    config = GlueConfig.from_env(env)
    assert config.beat_schedule == default_schedule(env, "app1")
    conf = celery_conf(config)
    assert conf["beat_schedule_filename"] == config.beat_schedule
    assert conf["beat_scheduler"] == BEAT_SCHEDULER
    assert GlueConfig(settings=Settings(prefix="p2")).beat_schedule.endswith(
        "gpuhedge-celery/celerybeat-schedule-p2"
    )


def test_the_schedule_file_is_a_setting():
    config = GlueConfig.from_env({"GPUHEDGE_BEAT_SCHEDULE": " /var/lib/x/beat "})
    assert config.beat_schedule == "/var/lib/x/beat"
    assert config.as_celery_conf()["gpuhedge_beat_schedule"] == "/var/lib/x/beat"


def test_gitignore_covers_celery_beat_files():
    lines = (REPO / ".gitignore").read_text().splitlines()
    assert "celerybeat-schedule*" in lines


def start_beat(cluster, cwd: Path, env: dict[str, str]) -> CeleryWorker:
    """``celery -A gpuhedge_celery beat`` with no ``--schedule``, started from ``cwd``."""
    cwd.mkdir(parents=True, exist_ok=True)
    log_path = cwd.parent / "beat.log"
    argv = [sys.executable, "-m", "celery", "-A", "gpuhedge_celery", "beat", "-l", "INFO"]
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            argv, env={**cluster.env, **env}, stdout=log_file, stderr=subprocess.STDOUT,
            cwd=str(cwd), start_new_session=True,
        )  # fmt: skip
    beat = CeleryWorker("beat", process, log_path, env)
    cluster.workers.append(beat)  # killed at teardown
    return beat


def schedule_files(folder: Path, stem: str) -> list[Path]:
    return sorted(folder.glob(f"{stem}*")) if folder.is_dir() else []


@pytest.mark.redis
@pytest.mark.celery
@pytest.mark.parametrize("how", ["default", "setting"])
def test_beat_leaves_nothing_in_its_working_directory(celery_cluster, tmp_path, how):
    c = celery_cluster
    cwd = tmp_path / "cwd"
    env = {"XDG_STATE_HOME": str(tmp_path / "state")}
    if how == "default":
        folder, stem = tmp_path / "state" / "gpuhedge-celery", f"celerybeat-schedule-{c.prefix}"
    else:  # a directory that does not exist yet
        folder, stem = tmp_path / "var" / "lib" / "beat", "schedule"
        env["GPUHEDGE_BEAT_SCHEDULE"] = str(folder / stem)
    beat = start_beat(c, cwd, env)
    wait_for(
        lambda: schedule_files(folder, stem) and "beat: Starting..." in beat.log(),
        30,
        f"beat's schedule file in {folder}\n{beat.log()[-3000:]}",
    )
    assert beat.alive(), beat.log()[-3000:]
    assert f"db -> {folder / stem}" in beat.log()
    assert list(cwd.iterdir()) == []
