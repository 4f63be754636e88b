"""What the test command does to the machine it runs on.

``scripts/ensure-prometheus.sh`` is run for real (bash, mktemp, the real ``dpkg-deb``) with the
package tools that change the system replaced by recorders: ``apt-get download`` hands over a
``prometheus`` .deb built here with ``dpkg-deb -b`` (binaries and a systemd unit, like Debian's),
and every other call is only logged. PATH is a copy of the machine's with any ``prometheus`` and
``promtool`` left out, so the script has to fetch them.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "ensure-prometheus.sh"
RECORDED = ("apt-get", "apt-cache", "sudo", "dpkg", "systemctl", "deb-systemd-helper",
            "deb-systemd-invoke", "invoke-rc.d", "update-rc.d", "service", "adduser",
            "useradd")  # fmt: skip
HIDDEN = ("prometheus", "promtool")


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _fake_deb(tmp: Path) -> Path:
    """A ``prometheus`` package shaped like Debian's: two binaries and a systemd unit."""
    root = tmp / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        "Package: prometheus\nVersion: 9.9.9\nArchitecture: all\n"
        "Maintainer: test <test@example.invalid>\nDescription: stand-in\n"
    )
    (root / "usr" / "bin").mkdir(parents=True)
    for name in HIDDEN:
        _executable(root / "usr" / "bin" / name, f"#!/bin/sh\necho '{name}, version 9.9.9'\n")
    unit = root / "lib" / "systemd" / "system" / "prometheus.service"
    unit.parent.mkdir(parents=True)
    unit.write_text(
        "[Service]\nExecStart=/usr/bin/prometheus\n[Install]\nWantedBy=multi-user.target\n"
    )
    deb = tmp / "prometheus_9.9.9_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(root), str(deb)], check=True,
                   capture_output=True)  # fmt: skip
    return deb


def _path_without_prometheus(tmp: Path, log: Path, deb: Path) -> str:
    """A PATH of links to the machine's commands, recorders in place of the package tools."""
    shims = tmp / "shims"
    shims.mkdir()
    for name in RECORDED:
        body = f'#!/bin/sh\necho "{name} $*" >> "{log}"\n'
        if name == "apt-get":  # `apt-get download NAME` leaves NAME's .deb in the current dir
            body += f'[ "$1" = download ] || [ "$2" = download ] && cp "{deb}" .\n'
        _executable(shims / name, body + "exit 0\n")
    links = tmp / "links"
    links.mkdir()
    for entry in os.environ["PATH"].split(os.pathsep):
        if not entry or not Path(entry).is_dir():
            continue
        for child in Path(entry).iterdir():
            target = links / child.name
            if child.name in HIDDEN or child.name in RECORDED or target.exists():
                continue
            if child.is_file() and os.access(child, os.X_OK):
                target.symlink_to(child)
    return f"{shims}{os.pathsep}{links}"


def test_ensure_prometheus_unpacks_the_binaries_and_never_installs_or_enables_a_service(
    tmp_path,
):
    log = tmp_path / "calls.log"
    log.touch()
    deb = _fake_deb(tmp_path)
    tools = tmp_path / "tools"
    env = {"PATH": _path_without_prometheus(tmp_path, log, deb), "HOME": str(tmp_path / "home"),
           "GPUHEDGE_TOOLS_DIR": str(tools)}  # fmt: skip

    def ensure() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip

    out = ensure()
    assert out.returncode == 0, out.stderr
    bin_dir = Path(out.stdout.strip().splitlines()[-1])
    assert bin_dir.is_relative_to(tools), bin_dir  # a private directory, not the system's
    for name in HIDDEN:
        run = subprocess.run([str(bin_dir / name), "--version"], capture_output=True, text=True)
        assert run.stdout.startswith(f"{name}, version 9.9.9"), run
    calls = log.read_text().splitlines()
    assert any(c.startswith("apt-get download") and "prometheus" in c for c in calls), calls
    changing = [c for c in calls if c.split()[0] not in ("apt-get", "apt-cache", "sudo")
                or " install" in c or c.startswith("sudo dpkg")]  # fmt: skip
    assert changing == [], f"the script changed the system: {changing}"
    assert not [p for p in tools.rglob("*") if p.name.endswith(".service")]
    # the second run finds its own copy and asks apt for nothing
    log.write_text("")
    again = ensure()
    assert again.returncode == 0 and again.stdout.strip() == str(bin_dir), again.stderr
    assert log.read_text() == ""


def _test_command_calls(tmp_path: Path, *args: str) -> list[str]:
    """Run a copy of scripts/test.sh whose python3, apt-get, sudo and ensure-*.sh only log."""
    log = tmp_path / "calls.log"
    log.touch()
    copy = tmp_path / "repo" / "scripts"
    copy.mkdir(parents=True)
    (copy / "test.sh").write_text((REPO / "scripts" / "test.sh").read_text())
    for name in ("ensure-redis.sh", "ensure-rabbitmq.sh", "ensure-prometheus.sh"):
        (copy / name).write_text(f'echo "{name}" >> "{log}"\necho /nowhere\n')
    shims = tmp_path / "shims"
    shims.mkdir()
    for name in ("python3", "apt-get", "sudo", "systemd-analyze", "espeak-ng"):
        _executable(shims / name, f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexit 0\n')
    env = {"PATH": f"{shims}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path)}
    command = ["bash", str(copy / "test.sh"), *args]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return log.read_text().splitlines()


def test_the_fast_tier_installs_the_package_and_sets_up_no_server(tmp_path):
    calls = _test_command_calls(tmp_path, "--fast", "-x")
    assert calls[0].startswith("python3 -m pip install") and "-e .[test]" in calls[0]
    assert "python3 -m mypy" in calls and "python3 -m ruff check ." in calls
    assert calls[-1].startswith("python3 -m pytest -q --fast") and calls[-1].endswith(" -x")
    assert " -n 2 " in calls[-1]  # two xdist processes keep the tier under a minute on 2 cores
    assert not [c for c in calls if c.startswith(("ensure-", "apt-get", "sudo"))], calls


def test_the_full_run_sets_up_the_servers_and_prints_the_slowest_tests(tmp_path):
    calls = _test_command_calls(tmp_path, "tests/test_readme.py")
    for name in ("ensure-redis.sh", "ensure-rabbitmq.sh", "ensure-prometheus.sh"):
        assert name in calls, calls
    assert "python3 -m mypy" in calls
    assert calls[-1] == "python3 -m pytest -q --durations=25 tests/test_readme.py"
