"""The systemd units pass credentials by environment file only, never on a command line (which
``ps`` shows every user of the host) nor in the unit itself (which ``systemctl show`` prints to
any user): the Redis URL with its password comes from ``gpuhedge.env``, the webhook secret
from ``webhooks.env``, the provider API keys from ``providers.env`` (read only by the units
that call providers), all mode 0600 (the compose and Kubernetes files are checked in
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


PROVIDER_FILE = "-/etc/gpuhedge/providers.env"  # optional: a sim-only fleet has no keys
CALLS_PROVIDERS = {"gpuhedge-coordinator.service", "gpuhedge-webhooks.service"}


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_only_the_units_that_call_providers_read_the_provider_keys(unit):
    """GPU workers run the model's code: the provider API keys stay out of their environment."""
    reads = PROVIDER_FILE in settings(unit)["EnvironmentFile"]
    assert reads == (unit.name in CALLS_PROVIDERS), unit.name


@pytest.mark.parametrize("env_file", [SECRET_FILE, PROVIDER_FILE])
def test_the_env_template_names_the_units_that_read_each_secret_file(env_file):
    """``gpuhedge.env``'s comments say where each secret goes and which units read it, as the
    units do."""
    readers = sorted(u.stem for u in UNITS if env_file in settings(u)["EnvironmentFile"])
    comments = " ".join(
        line.lstrip("# ").strip()
        for line in (DEPLOY / "systemd" / "gpuhedge.env").read_text().splitlines()
        if line.startswith("#")
    )
    path = env_file.lstrip("-")
    assert path in comments
    said = comments.split(path, 1)[1].split(".")[0]  # the rest of that sentence
    assert f"read by {' and '.join(readers)} only" in said, said
