"""``gpuhedge-celery bench pool --runner SPEC [--runner SPEC ...]``: per-job overhead of runners.

For each runner spec the bench starts real Celery workers on the real Redis (one coordination
worker, and one GPU worker per runner in a pool of its own, under a throw-away key and broker
prefix), waits until the GPU serves (a warm model loaded, a model server ready), sends a few
warm-up requests, then ``--jobs`` requests one after another (closed loop: no queueing) and
measures each from the client's ``send_pooled`` to its ``.get()``. ``--dispatch`` says how each
is sent: ``queued`` through ``pooled_infer`` on the coordination worker (its wait, its claim,
its hand-off to the GPU's queue), ``direct`` by the caller claiming the free GPU and sending
``gpu_run`` to it (``tasks/pooled_direct.py``), ``both`` (default) interleaved:

``e2e_ms``
    send to result, as a caller sees it.
``compute_ms``
    the model's own compute: the output's ``compute_s`` when the runner reports one (the tiny
    model and model server of tests/support do), else the runner's whole ``run_s``.
``overhead_ms`` = e2e - compute
    everything the pool adds around the model: the lease (wait_claim), the dispatch to the GPU
    worker, the fencing check, the lease renewal thread, the result through the backend, and the
    runner's own cost (an HTTP round trip for ``server:``, a process start, imports and a model
    load per job for a ``cmd:`` cold start).
``runner_ms`` = run_s - compute; ``scheduling_ms`` = e2e - run_s, split (wall clocks of one
host) into ``lease_ms`` (send to the coordinator holding the lease: its pickup, the wait
queue's claim script), ``dispatch_ms`` (lease to the GPU worker starting the job) and
``result_ms`` (the job's end to the caller holding the result: lease release, result store);
the dispatch is itself ``hop_ms`` (the broker and the worker's hand-over into its child) and
``start_ms`` (``gpu_run``'s checks and helper threads before the runner starts).

Run it from a clone's root so the workers can import ``tests.support`` (the bench puts the
current directory on their ``PYTHONPATH``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import uuid
from typing import Any

import click

from ..store.keys import all_keys

DEFAULT_REQUEST = {"x": [0.5, 1.0], "prompt": "hello", "max_tokens": 1}
HARNESS = (
    "real celery workers (1 coordinator, 1 GPU worker per runner, prefork, 1 child) on the real "
    "Redis; one request at a time from this process, runners and dispatches interleaved job by "
    "job: send_pooled to .get(), queued (pooled_infer on the coordinator) or direct (the caller "
    "claims the free GPU and sends gpu_run to it)"
)


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": round(pct(values, 50), 3),
        "p95": round(pct(values, 95), 3),
        "max": round(max(values), 3),
        "mean": round(statistics.fmean(values), 3),
    }


def sender(app: Any, pool: str, request: Any, dispatch: str) -> Any:
    """What sends one request of this case: ``send_pooled``, direct or always queued."""
    from ..tasks.pooled_result import send_pooled

    return lambda: send_pooled(app, request, pool=pool, direct=dispatch == "direct")


def measure_job(send: Any, timeout_s: float) -> dict[str, float]:
    """One pooled request (``send()`` returns its AsyncResult), timed from send to result,
    split as the module docstring says."""
    sent_at = time.time()
    started = time.perf_counter()
    result = send()
    out = result.get(timeout=timeout_s)
    e2e = time.perf_counter() - started
    run_s = float(out["run_s"])
    dispatch_s = float(out.get("dispatch_s") or 0.0)
    lease_s = float(out["started_at"]) - dispatch_s - sent_at
    entered = out.get("entered_at")  # when gpu_run began: splits the dispatch in two
    start_s = float(out["started_at"]) - float(entered) if entered else 0.0
    output = out.get("output")
    compute = output.get("compute_s") if isinstance(output, dict) else None
    compute = run_s if compute is None else float(compute)
    result.forget()
    return {
        "e2e_ms": e2e * 1000,
        "compute_ms": compute * 1000,
        "overhead_ms": (e2e - compute) * 1000,
        "runner_ms": (run_s - compute) * 1000,
        "scheduling_ms": (e2e - run_s) * 1000,
        "lease_ms": lease_s * 1000,
        "dispatch_ms": dispatch_s * 1000,
        "hop_ms": (dispatch_s - start_s) * 1000,
        "start_ms": start_s * 1000,
        "result_ms": (e2e - lease_s - dispatch_s - run_s) * 1000,
        "attempt": out["attempt"],
    }


def run_overhead(
    settings: Any,
    runners: tuple[str, ...],
    *,
    jobs: int,
    warmup: int,
    request: Any,
    server_cmd: str | None,
    ready_timeout_s: float = 180.0,
    dispatches: tuple[str, ...] = ("queued",),
) -> dict[str, Any]:
    """Measure every runner (see the module docstring); the JSON report."""
    from ..demo.workers import LocalWorkers
    from ..store.availability import out_reasons
    from ..store.connection import client_for
    from ..store.leases import LeaseStore
    from ..store.listener import enable_notifications
    from ..tasks.app import create_app
    from ..tasks.config import GlueConfig

    client = client_for(settings.redis_url)
    enable_notifications(client)
    prefix = f"{settings.prefix}-benchrun-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUHEDGE_")}
    env.update(
        {
            "GPUHEDGE_REDIS_URL": settings.redis_url,
            "GPUHEDGE_PREFIX": prefix,
            "GPUHEDGE_BROKER_PREFIX": f"{prefix}:",
            "GPUHEDGE_HOST": "bench",
            "GPUHEDGE_COORD_CONCURRENCY": "4",
            "GPUHEDGE_HEALTH": "off",
            "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
    )
    app = create_app(GlueConfig.from_env(env))
    store = LeaseStore(client, prefix)
    workers = LocalWorkers(env)
    results = []
    try:
        workers.start("coord")
        for i, spec in enumerate(runners):
            extra = {"GPUHEDGE_GPU": str(i), "GPUHEDGE_POOL": f"r{i}", "GPUHEDGE_RUNNER": spec}
            if spec.startswith("server:") and server_cmd:
                extra["GPUHEDGE_SERVER_CMD"] = server_cmd
            workers.start(f"gpu{i}", **extra)
        workers.wait_ready(ready_timeout_s)
        deadline = time.monotonic() + ready_timeout_s
        for i, spec in enumerate(runners):  # every GPU serves before any is measured
            while out_reasons(store, f"bench:{i}") or not store.gpus(f"r{i}"):
                if time.monotonic() > deadline:
                    raise click.ClickException(
                        f"{spec}: the GPU never served: {out_reasons(store, f'bench:{i}')}"
                    )
                time.sleep(0.1)
        cases = [(i, how) for i in range(len(runners)) for how in dispatches]
        sends = [sender(app, f"r{i}", request, how) for i, how in cases]
        for send in sends:
            for _ in range(warmup):
                measure_job(send, ready_timeout_s)
        rows: list[list[dict[str, float]]] = [[] for _ in cases]
        for _ in range(jobs):  # interleaved, so every runner sees the same machine
            for n, send in enumerate(sends):
                rows[n].append(measure_job(send, ready_timeout_s))
        keys = (
            "e2e_ms",
            "compute_ms",
            "overhead_ms",
            "scheduling_ms",
            "lease_ms",
            "dispatch_ms",
            "hop_ms",
            "start_ms",
            "result_ms",
            "runner_ms",
        )
        for (i, how), measured in zip(cases, rows, strict=True):
            results.append(
                {
                    "runner": runners[i],
                    "dispatch": how,
                    "jobs": jobs,
                    "retried": sum(1 for r in measured if r["attempt"]),
                    **{k: summary([r[k] for r in measured]) for k in keys},
                }
            )
    finally:
        workers.stop()
        for key in client.scan_iter(all_keys(prefix), count=1000):
            client.delete(key)
    return {
        "bench": "pool-runners",
        "harness": HARNESS,
        "request": request,
        "warmup": warmup,
        "target": "overhead p50 <= 5 ms with a warm model",
        "results": results,
    }


def print_report(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for r in report["results"]:
        click.echo(
            f"{r['runner']} ({r['dispatch']}): overhead p50 {r['overhead_ms']['p50']:.2f} ms "
            f"p95 {r['overhead_ms']['p95']:.2f} ms (e2e p50 {r['e2e_ms']['p50']:.2f} ms, "
            f"compute p50 {r['compute_ms']['p50']:.2f} ms, scheduling p50 "
            f"{r['scheduling_ms']['p50']:.2f} ms = lease {r['lease_ms']['p50']:.2f} + dispatch "
            f"{r['dispatch_ms']['p50']:.2f} + result {r['result_ms']['p50']:.2f} ms; runner p50 "
            f"{r['runner_ms']['p50']:.2f} ms)"
        )


def runner_options(command: Any) -> Any:
    """The ``bench pool`` options of this mode (``--runner`` switches the bench to it)."""
    options = [
        click.option(
            "--runner",
            "runners",
            multiple=True,
            metavar="SPEC",
            help="Measure per-job overhead of real GPU workers with this runner instead "
            "(repeatable).",
        ),
        click.option(
            "--jobs",
            default=50,
            show_default=True,
            help="With --runner: requests measured per runner.",
        ),
        click.option(
            "--warmup", default=5, show_default=True, help="With --runner: requests not measured."
        ),
        click.option(
            "--request",
            "request_json",
            default=None,
            metavar="JSON",
            help="With --runner: the request sent (default: one each kind accepts).",
        ),
        click.option(
            "--server-cmd",
            default=None,
            metavar="CMD",
            help="With --runner server:...: GPUHEDGE_SERVER_CMD for its GPU worker.",
        ),
        click.option(
            "--dispatch",
            type=click.Choice(["both", "direct", "queued"]),
            default="both",
            show_default=True,
            help="With --runner: requests sent straight to the free GPU (direct), "
            "through a coordination worker's wait (queued), or both interleaved.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def run_from_cli(
    settings: Any,
    runners: tuple[str, ...],
    jobs: int,
    warmup: int,
    request_json: str | None,
    server_cmd: str | None,
    as_json: bool,
    dispatch: str = "both",
) -> None:
    """``bench pool --runner ...``: measure and print."""
    if jobs < 1 or warmup < 0:
        raise click.BadParameter("--jobs must be >= 1 and --warmup >= 0")
    try:
        request = json.loads(request_json) if request_json else DEFAULT_REQUEST
    except ValueError as e:
        raise click.BadParameter(f"--request is not JSON: {e}") from None
    dispatches = ("queued", "direct") if dispatch == "both" else (dispatch,)
    report = run_overhead(
        settings,
        runners,
        jobs=jobs,
        warmup=warmup,
        request=request,
        server_cmd=server_cmd,
        dispatches=dispatches,
    )
    print_report(report, as_json)
