"""The checks of scripts/gpu-check.sh, on a host with an NVIDIA GPU (run through that script).

1. NVML through the real binding: driver, devices, each device's answers recorded to
   ``OUT/nvml-answers.json`` (the format tests/data/nvml/answers.json has, replayable with
   ``GPUHEDGE_NVML_REPLAY``), and what the health rules conclude from them.
2. A real GPU worker (Celery, prefork, one child) for GPU 0 with the tiny PyTorch network of
   tests/support/tiny_model.py as a warm ``python:`` runner, and a coordinator, on the Redis at
   ``GPUHEDGE_TEST_REDIS_URL``: the network loads on CUDA in the child, once for all jobs; NVML
   lists the child, not the worker's main process, on GPU 0 (CUDA only in the child); the
   worker's own health reading finds no foreign process; ``leases`` shows it.
3. ``gpus drain`` / ``undrain`` of that GPU while a job runs on it.

Every check prints ``PASS`` or ``FAIL`` and a detail line; the exit status is the number of
failures. Nothing here runs on a machine without a GPU (step 1 fails at once there).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        FAILED.append(name)
    return ok


def nvml_checks(out: Path) -> None:
    from gpuhedge_celery.core.gpu_health import assess, device_sample
    from gpuhedge_celery.nvml import NvmlUnavailable, PynvmlSource, record
    from gpuhedge_celery.tasks.health import process_tree

    try:
        source = PynvmlSource()
    except NvmlUnavailable as e:
        check("NVML starts", False, str(e))
        return
    try:
        answers = record(source)
    finally:
        source.close()
    path = out / "nvml-answers.json"
    path.write_text(json.dumps(answers, indent=2, sort_keys=True) + "\n")
    devices = answers["devices"]
    check("NVML starts", bool(devices), f"driver {answers['driver']}, {len(devices)} device(s)")
    print(f"     answers recorded to {path}")
    ours = process_tree(os.getpid())
    for index, device in sorted(devices.items()):
        found = assess(device_sample(int(index), device), ours)
        r = found.report
        print(
            f"     device {index}: {r.get('name')} mem {r.get('memory_used_mb')}/"
            f"{r.get('memory_total_mb')} MiB util {r.get('utilization_pct')}% "
            f"processes {[p['pid'] for p in r.get('processes', [])]} "
            f"ECC {r.get('ecc_uncorrected')} -> health: {found.health or 'ok'}, "
            f"fault: {found.fault or 'none'}"
        )


def worker_checks(redis_url: str, out: Path) -> None:
    import redis

    from gpuhedge_celery.nvml import PynvmlSource
    from gpuhedge_celery.store.availability import out_reasons
    from gpuhedge_celery.tasks.app import TASK_POOLED_INFER
    from tests.support.fixtures_celery import CeleryCluster
    from tests.support.waiting import wait_for

    prefix = f"gpucheck{uuid.uuid4().hex[:6]}"
    log = out / "model.log"
    cluster = CeleryCluster(redis_url, prefix, Path(tempfile.mkdtemp(prefix="gpu-check-")))
    try:
        gpu = cluster.start_gpu(
            0,
            runner="python:tests.support.tiny_model:TinyModel",
            wait=False,
            PYTHONPATH=str(REPO),
            TINY_MODEL_LOG=str(log),
            GPUHEDGE_HEALTH="on",
            GPUHEDGE_HEALTH_INTERVAL_S="1",
        )
        cluster.wait_ready(gpu, cluster.start_coordinator(wait=False))
        gpu_id = cluster.gpu_id(0)
        try:
            wait_for(lambda: not out_reasons(cluster.store, gpu_id), 300, "the model to load")
            check("the model loads and the GPU joins the pool", True)
        except AssertionError as e:
            check("the model loads and the GPU joins the pool", False, str(e))
            return
        outs = [
            cluster.app.send_task(TASK_POOLED_INFER, ({"x": [i, 1.0], "steps": 20},)).get(
                timeout=120
            )["output"]
            for i in range(5)
        ]
        loads = [json.loads(line) for line in log.read_text().splitlines()]
        loads = [e for e in loads if e["event"] == "load"]
        check(
            "the network runs on CUDA",
            {o["device"] for o in outs} == {"cuda"},
            f"devices {sorted({o['device'] for o in outs})}",
        )
        check("one load served every job", len(loads) == 1, f"{len(loads)} load(s)")
        source = PynvmlSource()
        try:
            pids = {p.pid for p in source.sample(0).processes}
        finally:
            source.close()
        child = loads[0]["pid"] if loads else None
        check(
            "CUDA only in the child",
            child in pids and gpu.pid not in pids,
            f"child {child}, main {gpu.pid}, NVML processes on GPU 0: {sorted(pids)}",
        )
        time.sleep(2)
        (row,) = cluster.store.table()
        health = row.health or {}
        check(
            "the worker's health reading",
            health.get("source") == "nvml" and not health.get("health") and not health.get("fault"),
            json.dumps(
                {k: health.get(k) for k in ("memory_used_mb", "processes", "health", "fault")}
            ),
        )
        drain_checks(cluster, gpu_id)
    finally:
        cluster.close()
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(f"{prefix}:*"):
            client.delete(key)


def drain_checks(cluster, gpu_id: str) -> None:
    from click.testing import CliRunner

    from gpuhedge_celery.cli import cli
    from gpuhedge_celery.tasks.app import TASK_POOLED_INFER

    base = ["--redis-url", cluster.redis_url, "--prefix", cluster.prefix]
    job = cluster.app.send_task(TASK_POOLED_INFER, ({"steps": 40, "step_s": 0.05},))
    time.sleep(1.0)
    started = time.monotonic()
    drained = CliRunner().invoke(cli, [*base, "gpus", "drain", gpu_id])
    took = time.monotonic() - started
    check("gpus drain waits for the running job", drained.exit_code == 0 and job.ready(),
          f"{took:.1f} s; {drained.output.strip().splitlines()[-1:]}")  # fmt: skip
    waiting = cluster.app.send_task(TASK_POOLED_INFER, ({"steps": 1},))
    time.sleep(1.0)
    check("a drained GPU takes no new job", not waiting.ready())
    CliRunner().invoke(cli, [*base, "gpus", "undrain", gpu_id])
    check("undrain serves it", waiting.get(timeout=60)["gpu_id"] == gpu_id)


def main() -> int:
    out = Path(os.environ.get("GPU_CHECK_OUT") or tempfile.mkdtemp(prefix="gpu-check-out-"))
    out.mkdir(parents=True, exist_ok=True)
    nvml_checks(out)
    if not FAILED:
        worker_checks(os.environ["GPUHEDGE_TEST_REDIS_URL"], out)
    print(f"{len(FAILED)} check(s) failed" if FAILED else "all GPU checks passed")
    print(f"output in {out}")
    return len(FAILED)


if __name__ == "__main__":
    sys.exit(main())
