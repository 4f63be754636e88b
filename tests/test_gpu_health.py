"""GPU health from NVML through its seam: recorded answers, the rules, and what the worker does.

No GPU here, so NVML's answers come from tests/data/nvml/answers.json (the format
``python -m gpuhedge_celery.nvml record`` writes) or files the tests write; the real
``nvidia-ml-py`` package is exercised too, where it can only report that no driver answers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuhedge_celery.core.gpu_health import assess, device_sample
from gpuhedge_celery.core.lease_rules import OUT_FAULT, OUT_HEALTH
from gpuhedge_celery.core.reconcile import GpuReport, GpuView, plan
from gpuhedge_celery.nvml import NvmlUnavailable, PynvmlSource, ReplaySource, open_source
from gpuhedge_celery.store.availability import out_reasons, undrain
from gpuhedge_celery.tasks.config import GlueConfig
from gpuhedge_celery.tasks.health import HealthMonitor, process_tree, start_health_monitor
from tests.support.fixtures_leases import add_pool

ANSWERS = Path(__file__).parent / "data" / "nvml" / "answers.json"
OURS = {1001, 1002}


def judged(index: int, **kw):
    return assess(ReplaySource(str(ANSWERS)).sample(index), OURS, **kw)


def test_a_healthy_gpu_in_use_by_the_worker_itself():
    found = judged(0)
    assert found.health is None and found.fault is None
    r = found.report
    assert r["memory_total_mb"] == 81920.0 and r["memory_used_mb"] == 20992.0
    assert r["utilization_pct"] == 35 and r["processes"] == [
        {"pid": 1001, "used_mb": 20480.0, "ours": True}
    ]


@pytest.mark.parametrize(
    "index, kw, health, fault",
    [
        (1, {}, "pid 4242 (19968 MiB)", None),
        (1, {"foreign_mb": 30_000}, None, None),  # under the threshold: tolerated
        (2, {}, None, "2 uncorrected ECC error(s)"),
        (3, {}, None, "Xid error 79"),
        (4, {}, None, None),  # Xids 13 and 43 are raised by applications
        (4, {"xid_ignore": ()}, None, "Xid error 13, 43"),
        (5, {"foreign_mb": 1e9}, "pid 5151 (? MiB)", None),  # usage unknown: held
        (6, {"foreign_mb": 100}, "pid 6161 (154 MiB)", None),  # compute + graphics contexts
    ],
)
def test_rules(index, kw, health, fault):
    found = judged(index, **kw)
    assert (found.health is None) == (health is None)
    if health:
        assert health in found.health and "not this worker's" in found.health
    assert (found.fault is None) == (fault is None)
    if fault:
        assert fault in found.fault


RECORDED = Path(__file__).parent / "data" / "nvml" / "h200-recorded.json"


def test_answers_recorded_from_a_real_h200_replay_as_an_idle_healthy_gpu():
    """``nvml record`` on an NVIDIA H200 (driver 580.159.04, scripts/gpu-check.sh): the file the
    real binding wrote reads back through the replay seam, and the rules find the idle GPU
    healthy, with no process on it."""
    recorded = json.loads(RECORDED.read_text())
    assert recorded["source"] == "nvml" and recorded["driver"] == "580.159.04"
    found = assess(ReplaySource(str(RECORDED)).sample(0), set())
    assert found.health is None and found.fault is None
    r = found.report
    assert r["memory_total_mb"] == 143771.0 and r["processes"] == []
    assert r["ecc_uncorrected"] == 0 and r["utilization_pct"] == 0
    assert "no device 1 recorded" in ReplaySource(str(RECORDED)).sample(1).error


def test_answers_nvml_cannot_give():
    error = judged(7)
    assert error.report["error"] == "NVML: Unknown Error" and error.health is error.fault is None
    partial = judged(8)
    assert partial.report["ecc_uncorrected"] is None and partial.report["utilization_pct"] is None
    missing = judged(42)
    assert "no device 42 recorded" in missing.report["error"]
    assert device_sample(0, {}).memory_total_mb is None


def test_the_real_nvml_binding_without_a_driver():
    """This machine has nvidia-ml-py but no NVIDIA driver: the seam says so in one line. On a
    GPU host the same call opens NVML and reads device 0 (scripts/gpu-check.sh)."""
    try:
        source = PynvmlSource([0])
    except NvmlUnavailable as e:
        assert str(e).startswith("NVML did not start:") and "\n" not in str(e)
        return
    try:
        sample = source.sample(0)
        assert sample.error is None and sample.memory_total_mb > 0
    finally:
        source.close()


def test_replay_is_read_again_at_every_sample(tmp_path):
    path = tmp_path / "answers.json"
    data = json.loads(ANSWERS.read_text())
    path.write_text(json.dumps(data))
    source = open_source(str(path))
    assert source.sample(1).processes[1].pid == 4242
    data["devices"]["1"]["compute_processes"] = data["devices"]["1"]["compute_processes"][:1]
    path.write_text(json.dumps(data))
    assert [p.pid for p in source.sample(1).processes] == [1001]
    with pytest.raises(NvmlUnavailable, match="cannot read recorded NVML answers"):
        open_source(str(tmp_path / "missing.json"))


def test_process_tree_includes_descendants():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        import os

        tree = process_tree(os.getpid())
        assert os.getpid() in tree and child.pid in tree
        assert 1 not in tree
    finally:
        child.kill()
        child.wait()


def write_device(path: Path, device: dict) -> None:
    path.write_text(json.dumps({"devices": {"0": device}}))


def test_monitor_keeps_a_gpu_out_while_foreign_memory_is_held(lease_store, tmp_path):
    (gpu,) = add_pool(lease_store, "p", 1)
    answers = json.loads(ANSWERS.read_text())["devices"]
    path = tmp_path / "nvml.json"
    write_device(path, answers["1"])  # pid 4242 holds 19.5 GiB
    monitor = HealthMonitor(
        ReplaySource(str(path)), lease_store, gpu, 0,
        interval_s=60, foreign_mb=256, xid_ignore=(13,), root_pid=1001,
    )  # fmt: skip
    monitor.check()
    assert "pid 4242" in out_reasons(lease_store, gpu)[OUT_HEALTH]["detail"]
    assert lease_store.try_claim(gpu, "t") is None
    (row,) = lease_store.table("p")
    assert row.availability == "out" and row.health["processes"][1]["pid"] == 4242
    assert row.health["source"].startswith("replay:")
    write_device(path, answers["0"])
    monitor.check()
    assert out_reasons(lease_store, gpu) == {}, "back in the pool once the process is gone"
    write_device(path, answers["3"])  # Xid 79: fallen off the bus
    monitor.check()
    write_device(path, answers["0"])
    monitor.check()
    fault = out_reasons(lease_store, gpu)[OUT_FAULT]["detail"]
    assert fault == "Xid error 79", "a fault stays until an operator undrains the GPU"
    assert undrain(lease_store, [gpu]) == {gpu: True}
    assert monitor.samples == 4 and monitor.last["xids"] == []


def test_start_health_monitor_modes(lease_store, tmp_path):
    (gpu,) = add_pool(lease_store, "p", 1)
    base = {"GPUHEDGE_GPU": "0", "GPUHEDGE_HOST": "h1"}
    off = GlueConfig.from_env({**base, "GPUHEDGE_HEALTH": "off"})
    assert start_health_monitor(off, lease_store) is None
    if shutil.which("nvidia-smi") is None:  # no driver here: auto samples nothing, quietly
        assert start_health_monitor(GlueConfig.from_env(base), lease_store) is None
    path = tmp_path / "nvml.json"
    write_device(path, json.loads(ANSWERS.read_text())["devices"]["2"])
    config = GlueConfig.from_env({**base, "GPUHEDGE_NVML_REPLAY": str(path)})
    monitor = start_health_monitor(config, lease_store)
    try:
        assert monitor is not None and monitor.samples == 1, "sampled before the GPU joins"
        assert "ECC" in out_reasons(lease_store, gpu)[OUT_FAULT]["detail"]
    finally:
        monitor.stop()


def test_health_config_is_validated():
    from gpuhedge_celery.errors import ConfigError

    with pytest.raises(ConfigError, match="GPUHEDGE_HEALTH"):
        GlueConfig.from_env({"GPUHEDGE_HEALTH": "maybe"})
    with pytest.raises(ConfigError, match="GPUHEDGE_XID_IGNORE"):
        GlueConfig.from_env({"GPUHEDGE_XID_IGNORE": "13,x"})
    assert GlueConfig.from_env({"GPUHEDGE_XID_IGNORE": "79, 13"}).xid_ignore == (13, 79)
    with pytest.raises(ConfigError, match="GPUHEDGE_SERVER_CMD: cannot parse the command"):
        GlueConfig.from_env({"GPUHEDGE_SERVER_CMD": "vllm serve 'unclosed"})
    with pytest.raises(ConfigError, match="GPUHEDGE_MAX_TASKS_PER_CHILD"):
        GlueConfig.from_env({"GPUHEDGE_MAX_TASKS_PER_CHILD": "0"})


def test_reconcile_takes_out_what_a_worker_reported_and_redis_missed():
    views = [
        GpuView("h:0", "p", "h"),
        GpuView("h:1", "p", "h", out=frozenset({OUT_FAULT})),
        GpuView("h:2", "p", "h"),
    ]
    reports = {
        "h:0": GpuReport("h:0", (), {"fault": "Xid error 79", "health": None}),
        "h:1": GpuReport("h:1", (), {"fault": "Xid error 79"}),
        "h:2": GpuReport("h:2", (), {"health": "memory held by pid 9"}),
    }
    actions = plan(views, reports, now=0.0)
    assert [(a.kind, a.gpu_id, a.detail["reason"], a.reason) for a in actions] == [
        ("out", "h:0", "fault", "Xid error 79"),
        ("out", "h:2", "health", "memory held by pid 9"),
    ]


def test_nvml_record_command_without_a_driver():
    done = subprocess.run(
        [sys.executable, "-m", "gpuhedge_celery.nvml", "record"], capture_output=True, text=True
    )
    if done.returncode == 0:  # a GPU host: the recording replays
        assert json.loads(done.stdout)["devices"]["0"]["memory"]["total"] > 0
        return
    assert done.returncode == 1 and done.stderr.startswith("error: NVML did not start")
