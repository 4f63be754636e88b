"""The deployment files under deploy/, checked by the tools that would run them.

* systemd units: ``systemd-analyze verify`` (installed by scripts/test.sh where missing), run
  with ``--root`` on a directory that holds the units, the host's own system units (targets
  such as ``sysinit.target``) and an executable where the units expect the venv's ``celery``:
  verify checks that each ``ExecStart`` binary exists, and this machine has no
  ``/opt/gpuhedge/venv``. Any warning fails the test, not only a non-zero exit.
* Kubernetes manifests: ``kubernetes-validate`` (strict) against the newest Kubernetes version
  whose schemas it bundles (offline), plus what a schema cannot say: selectors match their pod
  labels, the Services find a pod.
* Compose file: the Compose specification's JSON schema (bundled by ``check-jsonschema``).
* ``deploy/redis.conf`` (and the copy in the Kubernetes ConfigMap): a real ``redis-server``
  starts on it, with the keyspace events the workers need and AOF persistence, and a lease with
  its fencing counter survives ``kill -9`` of the server.
* In every file: each celery command line parses with the installed Celery's own CLI (and each
  ``gpuhedge-celery`` one with ours), each environment passes ``GlueConfig.from_env`` (GPU
  worker settings included), and the runner command the GPU workers run is installed by the
  Dockerfile and answers a request.
* Metrics: every worker serves them (``GPUHEDGE_METRICS_PORT``) and ``metrics serve`` runs once;
  the Dockerfile installs the ``[metrics]`` extra; the Prometheus configurations under
  ``deploy/prometheus/`` pass ``promtool check config`` and scrape exactly the ports the files
  set (a port scraped where nothing serves, or served where nothing scrapes, fails).
"""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.runners import RunContext, runner_from_spec
from gpuhedge_celery.tasks.config import GlueConfig

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
K8S = DEPLOY / "k8s" / "gpuhedge.yaml"
COMPOSE = DEPLOY / "docker-compose.yml"
SCRAPE_STATIC = DEPLOY / "prometheus" / "prometheus.yml"  # compose services, systemd hosts
SCRAPE_K8S = DEPLOY / "prometheus" / "prometheus-kubernetes.yml"
# Where the deployment steps (docs/operations.md) put the files of deploy/ on a machine.
INSTALLED = {"/opt/gpuhedge/serve_once.py": DEPLOY / "serve_once.py"}
VENV_CELERY = "/opt/gpuhedge/venv/bin/celery"
VENV_PYTHON = "/opt/gpuhedge/venv/bin/python"
VENV_GPUHEDGE = "/opt/gpuhedge/venv/bin/gpuhedge-celery"


def _tool(name: str) -> str:
    found = shutil.which(name) or (
        str(Path(sys.executable).parent / name)
        if (Path(sys.executable).parent / name).exists()
        else None
    )
    assert found, (
        f"{name} is not installed; the README's test command (scripts/test.sh) installs it"
    )
    return found


# --------------------------------------------------------------------------- shared checks


def check_celery_argv(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """Parse a ``celery -A gpuhedge_celery <cmd> ...`` line with Celery's own click CLI.

    Unknown options, bad values and unknown commands raise click's UsageError, exactly as the
    real command would at start-up. Returns the sub-command and its parsed options.
    """
    import click
    from celery.bin.base import CLIContext
    from celery.bin.celery import celery

    from gpuhedge_celery.tasks.app import app

    assert Path(argv[0]).name == "celery", argv
    ctx = celery.make_context("celery", list(argv[1:]), resilient_parsing=False)
    assert ctx.params.get("app") == "gpuhedge_celery", argv
    ctx.obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # click 8.2+: protected_args
        tokens = [*getattr(ctx, "protected_args", []), *ctx.args]
    name, *rest = tokens
    command = celery.get_command(ctx, name)
    if command is None:
        raise click.UsageError(f"no celery command {name!r}")
    return name, command.make_context(name, rest, parent=ctx).params


def check_gpuhedge_argv(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """Parse a ``gpuhedge-celery <group> <cmd> ...`` line with our own click CLI; returns the
    command path (``metrics serve``) and its parsed options."""
    import click

    from gpuhedge_celery.cli import cli

    assert Path(argv[0]).name == "gpuhedge-celery", argv
    ctx = cli.make_context("gpuhedge-celery", list(argv[1:]), resilient_parsing=False)
    group, path = cli, []
    while isinstance(group, click.Group):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # click 8.2+: protected_args
            name, *rest = [*getattr(ctx, "protected_args", []), *ctx.args]
        command = group.get_command(ctx, name)
        if command is None:
            raise click.UsageError(f"no gpuhedge-celery command {' '.join([*path, name])!r}")
        ctx = command.make_context(name, rest, parent=ctx, resilient_parsing=False)
        group, path = command, [*path, name]
    return " ".join(path), ctx.params


def check_argv(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """A celery or gpuhedge-celery command line, parsed by its own CLI."""
    if Path(argv[0]).name == "gpuhedge-celery":
        return check_gpuhedge_argv(argv)
    return check_celery_argv(argv)


def metrics_port(argv: list[str], env: dict[str, str]) -> int | None:
    """The port a process of this command line and environment serves Prometheus metrics on."""
    from gpuhedge_celery.metrics.exposition import PORT_VAR, parse_port

    command, params = check_argv(argv)
    if command == "metrics serve":
        return int(params["port"])
    port = parse_port(env.get(PORT_VAR))
    assert port is None or command == "worker", f"{PORT_VAR} set for {command}: nothing serves it"
    return port


def check_env(env: dict[str, str]) -> GlueConfig:
    """The settings a process of this role would start with (raises ConfigError if bad)."""
    return GlueConfig.from_env({k: str(v) for k, v in env.items()})


def run_runner(spec: str) -> Any:
    """Run the runner ``spec`` names on one request, with installed paths mapped to deploy/."""
    kind, _, rest = spec.partition(":")
    assert kind == "cmd", f"expected the deploy files to run a command, got {spec!r}"
    argv = shlex.split(rest)
    if Path(argv[0]).name.startswith("python"):
        argv[0] = sys.executable
    argv = [str(INSTALLED.get(a, a)) for a in argv]
    assert Path(argv[1]).exists(), f"{spec}: {argv[1]} is not in the repository"
    runner = runner_from_spec("cmd:" + shlex.join(argv))
    return runner.run({"text": "hello", "n": 1}, RunContext(gpu_id="box:0", token=1))


def test_the_model_command_answers_a_request_through_the_cmd_runner():
    out = run_runner(f"cmd:python3 {next(iter(INSTALLED))}")
    assert out["echo"] == {"text": "hello", "n": 1}
    assert out["run_s"] >= 0 and out["host"]


def test_the_dockerfile_installs_the_model_command_where_the_manifests_expect_it():
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    copies = {tuple(line.split()[1:3]) for line in lines if line.startswith("COPY ")}
    for installed, source in INSTALLED.items():
        assert (str(source.relative_to(REPO)), installed) in copies


# --------------------------------------------------------------------------- systemd


def _unit_argv(unit: Path, instance: str = "0") -> list[str]:
    """The unit's ExecStart with the specifiers it uses filled in (%i, %H, %h)."""
    (line,) = [x for x in unit.read_text().splitlines() if x.startswith("ExecStart=")]
    line = line.removeprefix("ExecStart=").replace("%i", instance).replace("%H", "gpubox")
    return shlex.split(line)


def _env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def systemd_root(tmp_path: Path) -> Path:
    """A root for ``systemd-analyze verify --root``: our units, the host's, and the venv path."""
    host_units = next(
        (d for d in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
         if (d / "sysinit.target").exists()),
        None,
    )  # fmt: skip
    assert host_units, "no system units (sysinit.target) found; is systemd installed?"
    root = tmp_path / "root"
    shutil.copytree(host_units, root / "usr/lib/systemd/system", symlinks=True)
    etc = root / "etc/systemd/system"
    etc.mkdir(parents=True)
    for unit in UNITS:
        shutil.copy(unit, etc / unit.name)
    (root / "etc/gpuhedge").mkdir(parents=True)
    shutil.copy(DEPLOY / "systemd/gpuhedge.env", root / "etc/gpuhedge/gpuhedge.env")
    for exe in (VENV_CELERY, VENV_PYTHON, VENV_GPUHEDGE):
        path = root / exe.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o755)
    return root


def test_systemd_units_pass_systemd_analyze_verify(tmp_path):
    root = systemd_root(tmp_path)
    names = [u.name.replace("@.service", "@0.service") for u in UNITS]
    done = subprocess.run(
        [_tool("systemd-analyze"), "verify", f"--root={root}", "--man=no", *names],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), (
        done.stdout + done.stderr
    )


def test_systemd_analyze_verify_catches_a_broken_unit(tmp_path):
    """The check above can fail: a misspelt key and a missing binary are reported."""
    root = systemd_root(tmp_path)
    unit = root / "etc/systemd/system/gpuhedge-beat.service"
    unit.write_text(unit.read_text().replace("Restart=always", "Restrat=always"))
    (root / VENV_CELERY.lstrip("/")).unlink()
    done = subprocess.run(
        [_tool("systemd-analyze"), "verify", f"--root={root}", "--man=no", unit.name],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert "Restrat" in said and "is not executable" in said and done.returncode != 0


def _unit_env(unit: Path, instance: str = "0") -> dict[str, str]:
    env = _env_file(DEPLOY / "systemd/gpuhedge.env")
    for line in unit.read_text().splitlines():
        if line.startswith("Environment="):
            key, _, value = line.removeprefix("Environment=").partition("=")
            env[key] = value.replace("%i", instance)
    return env


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_systemd_units_run_real_commands_with_valid_settings(unit):
    argv = _unit_argv(unit)
    assert argv[0] in (VENV_CELERY, VENV_GPUHEDGE)
    command, params = check_argv(argv)
    config = check_env(_unit_env(unit))
    if unit.name.startswith("gpuhedge-gpu@"):
        assert command == "worker" and config.is_gpu_worker and config.gpu == "0"
        assert params["hostname"].startswith("gpu0@")
        assert run_runner(config.runner)["echo"]["text"] == "hello"
    elif "beat" in unit.name:
        assert command == "beat" and not config.is_gpu_worker
    elif "metrics" in unit.name:
        assert command == "metrics serve" and not config.is_gpu_worker
    elif "webhooks" in unit.name:
        assert command == "webhooks" and params["port"] == 8088 and params["workers"] == 2
    else:
        assert command == "worker" and not config.is_gpu_worker


def test_systemd_units_serve_metrics_on_the_ports_the_scrape_config_names():
    """Each worker unit serves metrics (GPU i on 955i), one unit runs metrics serve, and every
    port is one the scrape configuration uses for that role."""
    scraped = {port for _job, _host, port in static_targets()}
    ports = {}
    for unit in UNITS:
        for instance in ("0", "1", "9"):
            port = metrics_port(_unit_argv(unit, instance), _unit_env(unit, instance))
            ports.setdefault(unit.name, set()).add(port)
    assert ports["gpuhedge-gpu@.service"] == {9550, 9551, 9559}
    assert ports["gpuhedge-beat.service"] == {None}
    served = {p for name, found in ports.items() for p in found if p is not None}
    assert served == {9540, 9541, 9550, 9551, 9559}
    assert {9540, 9541, 9550, 9551} <= scraped, scraped
    # GPU 10's port (95510) does not exist: its worker refuses to start, naming the variable
    # (the unit's comment says to set the port in a drop-in from GPU 10 on)
    gpu_unit = DEPLOY / "systemd" / "gpuhedge-gpu@.service"
    with pytest.raises(ConfigError, match="GPUHEDGE_METRICS_PORT"):
        metrics_port(_unit_argv(gpu_unit, "10"), _unit_env(gpu_unit, "10"))
    assert "from GPU 10 set the port in a" in gpu_unit.read_text()


# --------------------------------------------------------------------------- Kubernetes


def _k8s_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(K8S.read_text()) if d]


def test_kubernetes_manifests_validate_against_a_current_kubernetes():
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    assert tuple(int(x) for x in version.split(".")[:2]) >= (1, 31), version
    docs = _k8s_docs()
    assert {d["kind"] for d in docs} >= {"ConfigMap", "Service", "StatefulSet", "Deployment"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError


def test_kubernetes_validation_can_fail():
    import kubernetes_validate

    (deployment, *_) = [d for d in _k8s_docs() if d["kind"] == "Deployment"]
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), True)


def test_kubernetes_selectors_services_commands_and_settings_fit_together():
    docs = _k8s_docs()
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    env = {k: v for k, v in config_map["data"].items() if k.startswith("GPUHEDGE_")}
    pod_labels = []
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items(), doc["metadata"]
        pod_labels.append(labels)
        for container in doc["spec"]["template"]["spec"]["containers"]:
            if _is_redis(container):
                continue
            argv = [a.replace("$(POD_NAME)", "gpuhedge-gpu-7c9d-x2") for a in container["args"]]
            command, params = check_argv(argv)
            config = check_env({**env, **_container_env(container)})
            if config.is_gpu_worker:
                assert command == "worker" and "nvidia.com/gpu" in container["resources"]["limits"]
                assert run_runner(config.runner)["echo"]["n"] == 1
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        assert any(selector <= labels.items() for labels in pod_labels), service["metadata"]


def _is_redis(container: dict[str, Any]) -> bool:
    return container["image"].startswith("redis:")


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    """A container's own environment as the kubelet builds it: ``$(NAME)`` expanded from the
    variables before it, a Secret's value standing in as ``secret-<key>``."""
    own: dict[str, str] = {"POD_NAME": "gpuhedge-gpu-7c9d-x2"}
    for e in container.get("env", []):
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        value = f"secret-{ref['key']}" if ref else e.get("value", "")
        own[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: own.get(m.group(1), m.group(0)), value)
    return own


def _pod_templates() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"]["template"] for d in _k8s_docs()
            if d["kind"] in ("Deployment", "StatefulSet")}  # fmt: skip


def _serving_port(template: dict[str, Any]) -> int | None:
    """The port a pod of this template serves metrics on, checked against its container port
    named ``metrics`` and its prometheus.io annotations."""
    (container,) = template["spec"]["containers"]
    if _is_redis(container):
        return None
    own = {e["name"]: e.get("value", "") for e in container.get("env", [])}
    port = metrics_port(container["args"], own)
    if port is None:
        return None
    named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert named.get("metrics") == port, (container["name"], named, port)
    notes = template["metadata"].get("annotations", {})
    assert notes == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port)}, notes
    return port


def test_kubernetes_workers_serve_metrics_and_prometheus_finds_every_one():
    """Every worker pod and one metrics serve pod serve metrics; the Kubernetes scrape config
    names exactly the headless Services that select them, on the ports they serve."""
    docs = _k8s_docs()
    templates = _pod_templates()
    serving = {name: _serving_port(t) for name, t in templates.items()}
    serving = {name: port for name, port in serving.items() if port is not None}
    assert set(serving) == {"gpuhedge-coordinator", "gpuhedge-gpu", "gpuhedge-metrics"}, serving
    (serve,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] ==
                "gpuhedge-metrics"]  # fmt: skip
    assert serve["spec"]["replicas"] == 1, "one metrics serve: the dashboard sums its gauges"
    services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
    config = yaml.safe_load(SCRAPE_K8S.read_text())
    found = set()
    for job in config["scrape_configs"]:
        for sd in job["dns_sd_configs"]:
            assert sd["type"] == "A"
            for name in sd["names"]:
                spec = services[name]  # KeyError: no such Service in the manifest
                assert spec.get("clusterIP") == "None", f"{name}: A records need a headless one"
                (port,) = spec["ports"]
                assert port["port"] == sd["port"] and port["targetPort"] == "metrics"
                selector = spec["selector"].items()
                selected = [n for n, t in templates.items()
                            if selector <= t["metadata"]["labels"].items()]  # fmt: skip
                assert selected and all(serving.get(n) == sd["port"] for n in selected), name
                found |= {(n, sd["port"], job["job_name"]) for n in selected}
    assert {(n, p) for n, p, _job in found} == set(serving.items())
    assert {job for n, _p, job in found if n == "gpuhedge-metrics"} == {"gpuhedge-redis"}


# --------------------------------------------------------------------------- Compose


def test_compose_file_follows_the_compose_specification():
    done = subprocess.run(
        [_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_services_run_real_commands_with_valid_settings():
    compose = yaml.safe_load(COMPOSE.read_text())  # merges the x-gpuhedge anchors
    services = compose["services"]
    redis_conf = services["redis"]["volumes"][0].split(":")[0]
    assert (COMPOSE.parent / redis_conf).resolve() == DEPLOY / "redis.conf"
    roles = {}
    for name, service in services.items():
        if name == "redis":
            continue
        build = service["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).exists()
        command, _params = check_argv(service["command"])
        config = check_env(service["environment"])
        roles[name] = (command, config.is_gpu_worker)
        if config.is_gpu_worker:
            runner_from_spec(config.runner)  # the cpu runner: parses
    assert sorted(roles.values()) == [
        ("beat", False), ("metrics serve", False), ("webhooks", False), ("worker", False),
        ("worker", True), ("worker", True)
    ]  # fmt: skip


def compose_metrics_ports() -> dict[str, int]:
    """Compose service → the port it serves metrics on (exposed on the compose network)."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    found = {}
    for name, service in services.items():
        if name == "redis":
            continue
        port = metrics_port(service["command"], service["environment"])
        if port is not None:
            assert str(port) in service.get("expose", []), f"{name} does not expose {port}"
            found[name] = port
    return found


def test_compose_workers_and_metrics_serve_are_scraped_where_they_serve():
    served = compose_metrics_ports()
    commands = yaml.safe_load(COMPOSE.read_text())["services"]
    workers = {n for n, s in commands.items() if s["command"][:4] == ["celery", "-A",
               "gpuhedge_celery", "worker"]}  # fmt: skip
    assert workers <= served.keys(), f"workers without a metrics port: {workers - served.keys()}"
    scraped = {(host, port) for _job, host, port in static_targets()}
    assert scraped == set(served.items()), (scraped, served)
    (serve,) = [n for n, s in commands.items() if s["command"][:3] == ["gpuhedge-celery",
                "metrics", "serve"]]  # fmt: skip
    jobs = {job for job, host, _port in static_targets() if host == serve}
    assert jobs == {"gpuhedge-redis"}, "metrics serve has a job of its own (one per deployment)"


# --------------------------------------------------------------------------- Prometheus


def static_targets() -> list[tuple[str, str, int]]:
    """(job, host, port) of every static target of the compose/systemd scrape config."""
    config = yaml.safe_load(SCRAPE_STATIC.read_text())
    found = []
    for job in config["scrape_configs"]:
        for group in job["static_configs"]:
            for target in group["targets"]:
                host, _, port = target.rpartition(":")
                found.append((job["job_name"], host, int(port)))
    return found


@pytest.mark.parametrize("config", [SCRAPE_STATIC, SCRAPE_K8S], ids=lambda p: p.name)
def test_scrape_configs_pass_promtool_check_config(config):
    from tests.support.prometheus_server import binary

    done = subprocess.run(
        [binary("promtool"), "check", "config", config.name],
        cwd=config.parent, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "gpuhedge-alerts.yml" in said and "1 rule files found" in said, said


def test_the_dockerfile_installs_the_metrics_extra():
    import configparser

    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    assert "prometheus_client" in setup["options.extras_require"]["metrics"]
    runs = [line for line in (DEPLOY / "Dockerfile").read_text().splitlines()
            if line.startswith("RUN pip install")]  # fmt: skip
    extras = [re.search(r"/src\[([^\]]*)\]", line) for line in runs]
    assert any(m and "metrics" in m.group(1).split(",") for m in extras), runs


# --------------------------------------------------------------------------- redis.conf


def _configmap_redis_conf(tmp_path: Path) -> Path:
    (config_map,) = [d for d in _k8s_docs() if d["kind"] == "ConfigMap"]
    path = tmp_path / "k8s-redis.conf"
    path.write_text(config_map["data"]["redis.conf"])
    return path


AUTH_INCLUDE = "include /etc/redis/gpuhedge-auth.conf"
PASSWORD = "0123456789abcdef0123456789abcdef"


def _with_auth_file(conf: Path, tmp_path: Path) -> Path:
    """``conf`` with its password file written where this test can: the include moved to it."""
    auth = tmp_path / "gpuhedge-auth.conf"
    auth.write_text(f"requirepass {PASSWORD}\n")
    auth.chmod(0o600)
    text = conf.read_text()
    assert text.count(AUTH_INCLUDE) == 1, f"{conf.name} does not include the password file"
    moved = tmp_path / f"auth-{conf.name}"
    moved.write_text(text.replace(AUTH_INCLUDE, f"include {auth}"))
    return moved


def _start_redis(conf: Path, workdir: Path, port: int) -> subprocess.Popen:
    import redis

    from tests.support.redis_server import answers

    # Options after the file override it: loopback only, a free port, this test's directory.
    argv = [_tool("redis-server"), str(conf), "--bind", "127.0.0.1", "--port", str(port),
            "--dir", str(workdir), "--daemonize", "no", "--logfile", ""]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while not answers(f"redis://:{PASSWORD}@127.0.0.1:{port}/0"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"redis-server did not start on {conf.name}: {process.stdout.read()!r}")
        time.sleep(0.05)
    redis.Redis(port=port, password=PASSWORD).ping()
    return process


@pytest.mark.parametrize("which", ["deploy/redis.conf", "k8s ConfigMap"])
def test_redis_conf_starts_with_keyspace_events_and_aof_and_keeps_leases(tmp_path, which):
    import redis

    from gpuhedge_celery.store.leases import GpuInfo, LeaseStore
    from gpuhedge_celery.store.listener import merged_flags
    from tests.support.redis_server import free_port

    conf = (
        DEPLOY / "redis.conf" if which == "deploy/redis.conf" else _configmap_redis_conf(tmp_path)
    )
    conf = _with_auth_file(conf, tmp_path)
    workdir, port = tmp_path / "data", free_port()
    workdir.mkdir()
    server = _start_redis(conf, workdir, port)
    try:
        client = redis.Redis(port=port, password=PASSWORD, decode_responses=True)
        names = ("notify-keyspace-events", "appendonly", "appendfsync", "maxmemory-policy")
        got = {k: client.config_get(k)[k] for k in names}
        assert merged_flags(got["notify-keyspace-events"]) is None, got  # E, g and x are on
        assert got["appendonly"] == "yes" and got["appendfsync"] == "everysec", got
        assert got["maxmemory-policy"] == "noeviction", got
        # A lease in flight, then the server dies uncleanly and comes back on its AOF.
        store = LeaseStore(client, "deploytest")
        store.register_gpu(GpuInfo("box:0", "default", "box"))
        lease = store.try_claim("box:0", "race-in-flight")
        assert lease is not None
        # Redis writes the AOF buffer before it replies unless a background fsync is still
        # running (a busy disk), when it may hold the write back for up to 2 s: wait it out.
        deadline = time.monotonic() + 5
        while int(client.info("persistence")["aof_buffer_length"]) > 0:
            assert time.monotonic() < deadline, client.info("persistence")
            time.sleep(0.01)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        server = _start_redis(conf, workdir, port)
        client = redis.Redis(port=port, password=PASSWORD, decode_responses=True)
        store = LeaseStore(client, "deploytest")
        assert store.current("box:0").token == lease.token, "the lease survived the restart"
        store.release(lease)
        again = store.try_claim("box:0", "next")
        assert again.token > lease.token, "fencing tokens never go back after a restart"
    finally:
        server.kill()
        server.wait(10)


def _directives(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            found.setdefault(words[0].lower(), []).append(" ".join(words[1:]))
    return found


@pytest.mark.parametrize("which", ["deploy/redis.conf", "k8s ConfigMap"])
def test_redis_ships_closed_and_asks_for_a_password(tmp_path, which):
    import redis

    from tests.support.redis_server import free_port

    conf = (
        DEPLOY / "redis.conf" if which == "deploy/redis.conf" else _configmap_redis_conf(tmp_path)
    )
    found = _directives(conf.read_text())
    assert found["bind"] == ["127.0.0.1 -::1"] and found["protected-mode"] == ["yes"], found
    assert "requirepass" not in found, "the password lives in its own file, not this one"
    # Without its password file Redis does not start at all: it fails closed.
    argv = [_tool("redis-server"), str(conf), "--port", str(free_port()), "--dir", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    assert done.returncode != 0 and "gpuhedge-auth.conf" in done.stdout + done.stderr
    # With it, a client without the password is refused; with it, served.
    workdir, port = tmp_path / "data", free_port()
    workdir.mkdir()
    server = _start_redis(_with_auth_file(conf, tmp_path), workdir, port)
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).set("k", "v")
        assert redis.Redis(port=port, password=PASSWORD).set("k", "v")
    finally:
        server.kill()
        server.wait(10)


def test_compose_publishes_no_redis_port_and_passes_the_password_by_environment():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    redis_service = services["redis"]
    assert "ports" not in redis_service, "Redis is reachable on the compose network only"
    assert redis_service["environment"]["REDIS_PASSWORD"] == "${REDIS_PASSWORD:?set REDIS_PASSWORD}"
    script = redis_service["command"][-1]
    assert "$$REDIS_PASSWORD" in script and "gpuhedge-auth.conf" in script
    assert "requirepass" not in " ".join(redis_service["command"][:-1])
    for name, service in services.items():
        if name != "redis":
            url = service["environment"]["GPUHEDGE_REDIS_URL"]
            assert url == "redis://:${REDIS_PASSWORD:?set REDIS_PASSWORD}@redis:6379/0", name
            assert not any("REDIS_PASSWORD" in str(a) for a in service["command"]), name


def test_kubernetes_pods_take_the_redis_password_from_a_secret():
    docs = _k8s_docs()
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert "GPUHEDGE_REDIS_URL" not in config_map["data"], "a ConfigMap is no place for a password"
    for template in _pod_templates().values():
        for container in template["spec"]["containers"]:
            refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
                    if "secretKeyRef" in e.get("valueFrom", {})}  # fmt: skip
            assert refs.get("REDIS_PASSWORD") == {"name": "gpuhedge-redis", "key": "password"}
            words = [*container.get("command", []), *container["args"]]
            assert not any("$(REDIS_PASSWORD)" in w for w in words), container["name"]
            if not _is_redis(container):
                env = _container_env(container)
                assert env["GPUHEDGE_REDIS_URL"] == "redis://:secret-password@gpuhedge-redis:6379/0"
