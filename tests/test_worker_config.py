"""A worker with a broken configuration refuses to start: exit status 2 and the one-line error,
before it says "ready" or takes a task (real ``celery -A gpuhedge_celery worker`` processes)."""

from __future__ import annotations

import pytest

from gpuhedge_celery.config import packaged_path

pytestmark = [pytest.mark.redis, pytest.mark.celery]

VALID = packaged_path("default.yaml").read_text()
EXIT_CONFIG = 2


def refused(worker, timeout_s: float = 60.0) -> str:
    """Wait for ``worker`` to exit; it must exit 2 without getting ready; its last line."""
    code = worker.process.wait(timeout_s)
    log = worker.log()
    assert code == EXIT_CONFIG, log[-3000:]
    assert " ready." not in log, log[-3000:]
    return log.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("providers: {\n  x: [\n", "invalid YAML at line 3, column 1"),
        (VALID + "polcy: {name: fixed}\n", "polcy: unknown key; did you mean 'policy'?"),
    ],
)
def test_a_coordination_worker_refuses_a_broken_config(celery_cluster, tmp_path, text, expected):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    worker = celery_cluster.start_coordinator(wait=False, GPUHEDGE_CONFIG=str(path))
    line = refused(worker)
    assert line.startswith(f"error: {path}: {expected}"), line


def test_a_coordination_worker_refuses_a_missing_explicit_config(celery_cluster, tmp_path):
    missing = tmp_path / "gone.yaml"
    worker = celery_cluster.start_coordinator(wait=False, GPUHEDGE_CONFIG=str(missing))
    line = refused(worker)
    assert line == f"error: {missing}: config file not found (from --config or GPUHEDGE_CONFIG)"


def test_a_valid_explicit_config_starts_and_a_gpu_worker_does_not_read_it(celery_cluster, tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(VALID)
    broken = tmp_path / "broken.yaml"
    broken.write_text("providers: [\n")
    c = celery_cluster
    coordinator = c.start_coordinator(wait=False, GPUHEDGE_CONFIG=str(good))
    gpu = c.start_gpu(0, wait=False, GPUHEDGE_CONFIG=str(broken))  # GPU workers run no races
    c.wait_ready(coordinator, gpu)
    assert coordinator.alive() and gpu.alive()


def test_a_gpu_worker_refuses_two_children(celery_cluster):
    # the click option's environment form: `celery worker -c 2`
    worker = celery_cluster.start_gpu(0, wait=False, CELERY_WORKER_CONCURRENCY="2")
    line = refused(worker)
    assert line.startswith("error: GPUHEDGE_GPU: a GPU worker runs one job at a time")
    assert "got 2 with" in line
