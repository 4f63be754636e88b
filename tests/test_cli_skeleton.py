"""The CLI's shared plumbing: exit codes, one-line errors, settings from the environment."""

from __future__ import annotations

import subprocess
import sys

from gpuhedge_celery.cli import EXIT_USAGE, main
from gpuhedge_celery.settings import Settings, redact_url


def test_help_lists_bench():
    proc = subprocess.run(
        [sys.executable, "-m", "gpuhedge_celery.cli", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    assert "bench" in proc.stdout


def test_bad_redis_url_is_one_line_usage_error(capsys):
    code = main(["--redis-url", "http://nope", "bench", "--help"])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USAGE
    assert len(err.splitlines()) == 1
    assert "GPUHEDGE_REDIS_URL" in err and "redis://" in err


def test_settings_repr_hides_password():
    s = Settings(redis_url="rediss://user:s3cret@redis.example:6380/2")
    assert "s3cret" not in repr(s)
    assert "***" in repr(s)
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_settings_from_env_prefix_validated():
    s = Settings.from_env({"GPUHEDGE_REDIS_URL": "redis://h:1/0", "GPUHEDGE_PREFIX": "app1"})
    assert s.redis_url == "redis://h:1/0" and s.prefix == "app1"
