"""Every worker role has its own node name: in the README's commands, the worker scripts and the
deployment files, and in the app's default when ``-n`` is not given (real worker processes)."""

from __future__ import annotations

import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpuhedge_celery.tasks.config import GlueConfig
from tests.support.fixtures_celery import CeleryWorker
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]
HOST = "%h"  # the host part of a default node name here, as the README writes it


def gpu_value(value: object) -> str | None:
    """``GPUHEDGE_GPU`` as the app reads it (``GlueConfig.from_env``): blank means unset."""
    return ("" if value is None else str(value)).strip() or None


def worker(tokens: list[str], gpu: str | None) -> tuple[str, str]:
    """(role, node name) of a ``celery ... worker`` command line run with ``GPUHEDGE_GPU=gpu``:
    its ``-n``, else the app's default (``_name_by_role``: ``gpu<index>@``, ``coord@``)."""
    role = "coord" if gpu is None else "gpu"
    for i, token in enumerate(tokens):
        if token in ("-n", "--hostname") and i + 1 < len(tokens):
            return role, tokens[i + 1]
        if token.startswith("--hostname="):
            return role, token.split("=", 1)[1]
    return role, GlueConfig(gpu=gpu).default_nodename(HOST)


def is_worker(tokens: list[str]) -> bool:
    return "gpuhedge_celery" in tokens and "worker" in tokens


def shell_workers(text: str, gpu_file: str | None = None) -> list[tuple[str, str]]:
    """(role, node name) of each worker command in shell text (README blocks, scripts, units;
    ``gpu_file``: the ``GPUHEDGE_GPU`` the file sets for all of them)."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.removeprefix("ExecStart=")
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        if is_worker(tokens):
            gpu = gpu_file
            for token in tokens:  # a VAR=value prefix; the last one wins, as in the shell
                if token.startswith("GPUHEDGE_GPU="):
                    gpu = token.split("=", 1)[1]
            found.append(worker(tokens, gpu_value(gpu)))
    return found


def yaml_workers(text: str) -> list[tuple[str, str]]:
    """(role, node name) of each container/service running a worker (compose, Kubernetes)."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            command = node.get("command") or node.get("args")
            if isinstance(command, list) and is_worker([str(c) for c in command]):
                env = node.get("environment") or {}  # compose: a mapping or NAME=value items
                if isinstance(env, list):
                    env = dict(str(e).partition("=")[::2] for e in env)
                env = {**env, **{e.get("name"): e.get("value") for e in node.get("env") or []}}
                gpu = gpu_value(env.get("GPUHEDGE_GPU"))
                found.append(worker([str(c) for c in command], gpu))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for document in yaml.safe_load_all(text):
        walk(document)
    return found


def unit_gpu(text: str) -> str | None:
    """The ``GPUHEDGE_GPU`` a systemd unit sets (``Environment=GPUHEDGE_GPU=%i``), if any."""
    found = re.findall(r"^Environment=GPUHEDGE_GPU=(\S*)", text, flags=re.M)
    return found[-1] if found else None


def bash_blocks(path: Path) -> str:
    return "\n".join(re.findall(r"```(?:bash|sh)\n(.*?)```", path.read_text(), flags=re.S))


def deployments() -> dict[str, list[tuple[str, str]]]:
    """Each place that starts a set of workers together -> its workers' (role, node name)."""
    units = sorted((REPO / "deploy" / "systemd").glob("*.service"))
    return {
        "README.md": shell_workers(bash_blocks(REPO / "README.md")),
        "docs/*.md": [w for d in sorted((REPO / "docs").glob("*.md")) for w in shell_workers(
            bash_blocks(d))],
        "workers/*.sh": [w for s in sorted((REPO / "workers").glob("*.sh"))
                         for w in shell_workers(s.read_text())],
        "deploy/systemd": [w for u in units for w in shell_workers(
            u.read_text(), gpu_file=unit_gpu(u.read_text()))],
        "deploy/docker-compose.yml": yaml_workers((REPO / "deploy/docker-compose.yml").read_text()),
        "deploy/k8s": yaml_workers((REPO / "deploy/k8s/gpuhedge.yaml").read_text()),
    }  # fmt: skip


def name_clashes(workers: list[tuple[str, str]]) -> list[str]:
    """What is wrong with the node names of workers started together: a role named like
    Celery's default, a name shared by two roles, two GPU workers under one literal name."""
    problems, roles_of = [], {}
    for role, name in workers:
        short = name.split("@", 1)[0]
        if short == "celery":
            problems.append(f"a {role} worker named {name}")
        if roles_of.setdefault(short, role) != role:
            problems.append(f"{short}@ is both {roles_of[short]} and {role}")
    gpu_names = [name for role, name in workers if role == "gpu"]
    if len(set(gpu_names)) < len(gpu_names):  # each carries its index, %i or pod name
        problems.append(f"GPU workers share a name: {gpu_names}")
    return problems


def test_no_two_roles_share_a_node_name_where_workers_are_started():
    found = deployments()
    assert len(found["README.md"]) >= 2, found["README.md"]
    for place, workers in found.items():
        if place != "docs/*.md":  # each doc shows one role; the others start a deployment
            assert {role for role, _ in workers} == {"coord", "gpu"}, (place, workers)
        assert not name_clashes(workers), (place, name_clashes(workers))


def test_name_clashes_are_found():
    readme_as_it_was = shell_workers(
        "celery -A gpuhedge_celery worker -n celery@%h\n"
        "GPUHEDGE_GPU=0 celery -A gpuhedge_celery worker -n celery@%h\n"
    )
    assert "celery@ is both coord and gpu" in name_clashes(readme_as_it_was)
    assert name_clashes([("gpu", "gpu@box"), ("gpu", "gpu@box")])
    assert name_clashes([("coord", "w@a"), ("gpu", "w@b")])


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("celery -A gpuhedge_celery worker -E -l INFO", [("coord", "coord@%h")]),
        ("GPUHEDGE_GPU=1 celery -A gpuhedge_celery worker  # one GPU", [("gpu", "gpu1@%h")]),
        ("GPUHEDGE_GPU=box:2 celery -A gpuhedge_celery worker", [("gpu", "gpu-box-2@%h")]),
        ("GPUHEDGE_GPU= celery -A gpuhedge_celery worker", [("coord", "coord@%h")]),
        ('GPUHEDGE_GPU="$i" \\\n  "$PY" -m celery -A gpuhedge_celery worker -n "gpu${i}@${H}"',
         [("gpu", "gpu${i}@${H}")]),
        ("celery -A gpuhedge_celery beat", []),
    ],
)  # fmt: skip
def test_worker_commands_are_read_with_their_names(line, expected):
    assert shell_workers(line) == expected


def test_worker_services_are_read_with_their_gpu_index():
    compose = """
services:
  coord: {command: [celery, -A, gpuhedge_celery, worker]}
  gpu1: {environment: {GPUHEDGE_GPU: 1}, command: [celery, -A, gpuhedge_celery, worker]}
  gpu2: {environment: [GPUHEDGE_GPU=2], command: [celery, -A, gpuhedge_celery, worker]}
  pod:
    containers:
      - {env: [{name: GPUHEDGE_GPU, value: "3"}], args: [celery, -A, gpuhedge_celery, worker]}
"""
    assert yaml_workers(compose) == [
        ("coord", "coord@%h"), ("gpu", "gpu1@%h"), ("gpu", "gpu2@%h"), ("gpu", "gpu3@%h")
    ]  # fmt: skip
    unit = "Environment=GPUHEDGE_GPU=%i\nExecStart=/v/bin/celery -A gpuhedge_celery worker\n"
    assert shell_workers(unit, gpu_file=unit_gpu(unit)) == [("gpu", "gpu%i@%h")]


def test_default_node_names_by_role():
    assert GlueConfig().default_nodename("box") == "coord@box"
    assert GlueConfig(gpu="3").default_nodename("box") == "gpu3@box"
    assert GlueConfig(gpu="rack1:3").default_nodename("box") == "gpu-rack1-3@box"


def start_unnamed(cluster, tmp_path: Path, label: str, **env: str) -> CeleryWorker:
    """``celery -A gpuhedge_celery worker`` without ``-n``, mingle on (it is what warns about
    duplicate node names), on the test's broker prefix."""
    log_path = tmp_path / f"{label}.log"
    argv = [sys.executable, "-m", "celery", "-A", "gpuhedge_celery", "worker",
            "--loglevel", "INFO", "--without-gossip", "--without-heartbeat"]  # fmt: skip
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            argv, env={**cluster.env, **env}, stdout=log_file, stderr=subprocess.STDOUT,
            cwd=str(tmp_path), start_new_session=True,
        )  # fmt: skip
    worker = CeleryWorker(label, process, log_path, env)
    cluster.workers.append(worker)  # killed at teardown
    return worker


@pytest.mark.redis
@pytest.mark.celery
def test_workers_started_without_a_name_are_named_by_role(celery_cluster, tmp_path):
    c = celery_cluster
    coordinator = start_unnamed(c, tmp_path, "coord")
    gpu = start_unnamed(c, tmp_path, "gpu", GPUHEDGE_GPU="0")
    for worker in (coordinator, gpu):
        ready = (lambda w: lambda: " ready." in w.log() or not w.alive())(worker)
        wait_for(ready, 60, f"{worker.nodename} ready")
        assert worker.alive(), worker.log()[-3000:]
    host = socket.gethostname()
    replies = wait_for(
        lambda: (
            {name for reply in c.app.control.ping(timeout=1) for name in reply}
            >= {f"coord@{host}", f"gpu0@{host}"}
        ),
        30,
        "both workers to answer a ping under their role's name",
    )
    assert replies
    assert c.store.host_live(f"gpu0@{host}")  # the GPU worker heartbeats under its name
    logs = coordinator.log() + gpu.log()
    assert f"coord@{host} ready." in logs and f"gpu0@{host} ready." in logs
    assert "DuplicateNodenameWarning" not in logs and f"celery@{host}" not in logs
