"""GPU discovery: configured indices, nvidia-smi parsing, and a real (fake-binary) nvidia-smi."""

from __future__ import annotations

import os
import stat

import pytest

from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.gpus import LocalGpu, discover_gpus, parse_labels, parse_nvidia_smi

SMI = """0, GPU-aaa, NVIDIA H100 80GB HBM3, 81559
1, GPU-bbb, NVIDIA H100 80GB HBM3, 81559
"""


def test_parse_nvidia_smi():
    gpus = parse_nvidia_smi(SMI)
    assert [g.index for g in gpus] == ["0", "1"]
    assert gpus[1].uuid == "GPU-bbb"
    assert gpus[0].memory_mb == 81559
    assert gpus[0].labels == {"model": "NVIDIA H100 80GB HBM3", "vram_mb": "81559"}
    assert gpus[0].gpu_id("box") == "box:0"


def test_parse_nvidia_smi_not_supported_memory():
    (gpu,) = parse_nvidia_smi("0, GPU-x, Tesla, [N/A]\n")
    assert gpu.memory_mb is None and "vram_mb" not in gpu.labels


def test_parse_nvidia_smi_rejects_garbage():
    with pytest.raises(ValueError):
        parse_nvidia_smi("No devices were found\n")


@pytest.mark.parametrize(
    "spec, indices",
    [("0", ["0"]), ("0,1,3", ["0", "1", "3"]), (" 2 , 5 ", ["2", "5"]), ("none", [])],
)
def test_configured_gpus(spec, indices):
    assert [g.index for g in discover_gpus(spec)] == indices


@pytest.mark.parametrize("spec", ["a", "0,,x", "0,0", "-1"])
def test_bad_gpu_list(spec):
    with pytest.raises(ConfigError, match="GPUHEDGE_GPUS"):
        discover_gpus(spec)


def _fake_smi(tmp_path, body: str, code: int = 0) -> str:
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!/bin/sh\ncat <<'OUT'\n{body}OUT\nexit {code}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_auto_discovery_runs_nvidia_smi(tmp_path):
    gpus = discover_gpus("auto", nvidia_smi=_fake_smi(tmp_path, SMI))
    assert [(g.index, g.uuid) for g in gpus] == [("0", "GPU-aaa"), ("1", "GPU-bbb")]


def test_auto_discovery_without_a_device(tmp_path):
    assert discover_gpus("auto", nvidia_smi=_fake_smi(tmp_path, "", code=9)) == []


def test_auto_discovery_without_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert not os.path.exists(tmp_path / "nvidia-smi")
    assert discover_gpus("auto") == []


def test_labels():
    assert parse_labels("model=llama, vram=80") == {"model": "llama", "vram": "80"}
    assert parse_labels("") == {}
    with pytest.raises(ConfigError, match="GPUHEDGE_GPU_LABELS"):
        parse_labels("model")
    assert LocalGpu("0").labels == {}


def test_a_gpu_worker_labels_its_gpu_from_nvidia_smi_then_config(monkeypatch, tmp_path):
    from gpuhedge_celery.tasks import signals

    _fake_smi(tmp_path, SMI)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    labels = signals.gpu_labels("1", {"model": "renamed", "zone": "b"})
    assert labels == {"model": "renamed", "vram_mb": "81559", "zone": "b"}
    assert signals.gpu_labels("7", {"zone": "b"}) == {"zone": "b"}
    assert signals.gpu_labels("box:1", {}) == {}


def test_gpu_host_script_starts_one_worker_per_gpu(redis_url, prefix, tmp_path):
    """workers/gpu-host.sh on a host with GPUs 0 and 1: two GPU workers register, TERM stops all."""
    import pathlib
    import signal
    import subprocess
    import sys
    import time

    import redis

    from gpuhedge_celery.store.leases import LeaseStore

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "GPUHEDGE_REDIS_URL": redis_url,
        "GPUHEDGE_PREFIX": prefix,
        "GPUHEDGE_BROKER_PREFIX": f"{prefix}:",
        "GPUHEDGE_GPUS": "0,1",
        "GPUHEDGE_HOST": f"{prefix}-box",
        "GPUHEDGE_POOL": "scripted",
        "PYTHON": sys.executable,
    }
    env.pop("GPUHEDGE_GPU", None)
    log = open(tmp_path / "gpu-host.log", "wb")
    proc = subprocess.Popen(
        ["bash", str(root / "workers" / "gpu-host.sh")],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
    )  # fmt: skip
    store = LeaseStore(redis.Redis.from_url(redis_url, decode_responses=True), prefix)
    try:
        deadline = time.monotonic() + 60
        while len(store.gpus("scripted")) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "gpu-host.log").read_text()
            time.sleep(0.2)
        assert [g.gpu_id for g in store.gpus("scripted")] == [f"{prefix}-box:0", f"{prefix}-box:1"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) != 0, "a stopped host exits non-zero so its supervisor restarts it"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.close()
