"""The systemd units pass credentials by environment file only, never on a command line (which
``ps`` shows every user of the host) nor in the unit itself (which ``systemctl show`` prints to
any user): the Redis URL with its password comes from ``gpuhedge.env``, the webhook secret
from ``webhooks.env``, both mode 0600 (the compose and Kubernetes files are checked in
``tests/test_deploy.py``)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from gpuhedge_celery.secrets import SECRET_NAME

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
ENV_FILE = "/etc/gpuhedge/gpuhedge.env"
SECRET_FILE = "-/etc/gpuhedge/webhooks.env"  # optional: webhooks may be off
CREDENTIAL_FLAGS = ("--redis-url", "--broker", "--password", "--secret", "--key", "--token")


def settings(unit: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def test_there_are_units_to_check():
    assert {u.name for u in UNITS} >= {
        "gpuhedge-coordinator.service",
        "gpuhedge-gpu@.service",
        "gpuhedge-webhooks.service",
    }


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_a_unit_takes_its_credentials_from_environment_files_only(unit):
    found = settings(unit)
    assert ENV_FILE in found["EnvironmentFile"], unit.name  # the Redis URL and its password
    for assignment in found.get("Environment", []):
        name, _, value = assignment.partition("=")
        assert not SECRET_NAME.search(name), assignment
        assert "://" not in value and "@" not in value, assignment
    for key in ("ExecStart", "ExecStartPre", "ExecStartPost", "ExecReload"):
        for line in found.get(key, []):
            for word in shlex.split(line):
                assert "://" not in word, (key, word)  # a URL, and its password
                assert not word.startswith(CREDENTIAL_FLAGS), (key, word)
                assert not SECRET_NAME.search(word.split("=", 1)[0]), (key, word)


@pytest.mark.parametrize("name", ["gpuhedge-coordinator.service", "gpuhedge-webhooks.service"])
def test_the_units_that_mint_or_check_webhook_tokens_read_the_secret_file(name):
    assert SECRET_FILE in settings(DEPLOY / "systemd" / name)["EnvironmentFile"]
