"""``gpuhedge-celery bench report``: ``report`` over 100,000 synthetic records, timed.

The records are generated (seeded) in our export format, with every field a race writes, and
a share in GPUHedge's live-record format (index lines joined with their full lines); they are
written to a temporary JSONL file. Two timings:

* ``in_process``: read and parse the file, summarise by policy, format the table (best of
  ``--repeat``), with the time split into reading and summarising;
* ``command``: the whole ``gpuhedge-celery report FILE`` as a fresh process (interpreter start
  and imports included), what a user waits for.

Target: the command under 2 s for 100,000 records.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from ..commands._options import shown
from ..store import codec

TARGET_S = 2.0
POLICIES = (
    ("hedge:runpod->modal@10s", ("runpod", "modal")),
    ("cutover:runpod->cerebrium@q2.5s+s8.5s", ("runpod", "cerebrium")),
    ("cascade:runpod->cerebrium->modal@q2.5s+s8.5s+e25s", ("runpod", "cerebrium", "modal")),
    ("single:runpod", ("runpod",)),
)


def our_record(rng: random.Random, i: int) -> dict[str, Any]:
    """One synthetic race record with every field of the export format."""
    policy, providers = POLICIES[i % len(POLICIES)]
    failed = rng.random() < 0.03
    hedged = len(providers) > 1 and rng.random() < 0.3
    winner = None if failed else providers[1 if hedged else 0]
    e2e = None if failed else rng.lognormvariate(9.5, 0.8)  # ms: median ~13 s
    usd = rng.uniform(0.001, 0.03)
    attempts = [
        {
            "provider": p,
            "role": role,
            "state": "COMPLETED" if p == winner else "CANCELLED",
            "usd": round(usd / 2, 6),
            "billed_usd": round(usd, 6),
        }
        for p, role in zip(providers[: 2 if hedged else 1], ("primary", "hedge"), strict=False)
    ]
    cancels = (
        [
            {
                "provider": providers[0],
                "evidence": "confirmed_terminal",
                "was_running": True,
                "terminal": "CANCELLED",
                "ack_ms": 260.0,
                "leaked": rng.random() < 0.001,
            }
        ]
        if hedged and not failed
        else []
    )
    return {
        "v": 1,
        "kind": "race",
        "race_id": f"r{i:07d}",
        "ts": 1783857600.0 + i,
        "started": 1783857600.0 + i - 20,
        "policy": policy,
        "providers": list(providers),
        "winner": winner,
        "e2e_ms": None if e2e is None else round(e2e, 1),
        "winner_ms": None if e2e is None else round(e2e * 0.9, 1),
        "hedged": hedged,
        "cut_over": hedged and policy.startswith("cutover"),
        "escalated": False,
        "attempts": attempts,
        "cancels": cancels,
        "leaked": any(c["leaked"] for c in cancels),
        "usd": round(usd, 6),
        "billed_usd": round(usd * 2, 6),
        "wasted_usd": round(usd / 2, 6) if hedged else 0.0,
        "budget_key": f"team-{i % 7}",
        "arm": None,
        "time_scale": 1.0,
    }


def gpuhedge_lines(rng: random.Random, request_id: int) -> list[dict[str, Any]]:
    """One GPUHedge validation request: its full line and its index line."""
    total = None if rng.random() < 0.03 else round(rng.lognormvariate(9.8, 0.7), 1)
    winner = None if total is None else "cerebrium"
    full = {
        "kind": "state_aware_request",
        "stage": "validation",
        "request_id": request_id,
        "policy": "cutover:runpod->cerebrium@q2.5s+s8.5s",
        "cutover_fired": True,
        "safety_hedge_fired": False,
        "winner": winner,
        "winner_valid_at_ms": total,
        "winner_total_ms": total,
        "cancellation": {"provider": "runpod", "leaked": False},
    }
    index = {
        "kind": "validation_index",
        "stage": "validation",
        "request_id": request_id,
        "arm": "queue-cutover",
        "policy": full["policy"],
        "winner": winner,
        "winner_total_ms": total,
        "cutover_fired": True,
        "safety_hedge_fired": False,
    }
    return [full, index]


def write_records(path: Path, n: int, gpuhedge_share: float, seed: int) -> int:
    """Write ``n`` requests (``gpuhedge_share`` of them in GPUHedge's format); returns bytes."""
    rng = random.Random(seed)
    theirs = int(n * gpuhedge_share)
    lines = [codec.dumps(our_record(rng, i)) for i in range(n - theirs)]
    for request_id in range(1, theirs + 1):
        lines.extend(codec.dumps(x) for x in gpuhedge_lines(rng, request_id))
    data = "\n".join(lines) + "\n"
    path.write_text(data)
    return len(data.encode())


def time_in_process(path: Path, repeat: int) -> dict[str, Any]:
    from ..commands.report import format_report, load_files
    from ..core.report import summarise

    best: dict[str, float] | None = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        loaded = load_files([str(path)])
        t1 = time.perf_counter()
        rows = summarise(loaded.requests, "policy", [60.0])
        format_report(loaded, rows, "policy", [60.0])
        t2 = time.perf_counter()
        run = {"read_s": t1 - t0, "summarise_s": t2 - t1, "total_s": t2 - t0}
        if best is None or run["total_s"] < best["total_s"]:
            best = run
    assert best is not None
    return {k: round(v, 3) for k, v in best.items()} | {"requests": len(loaded.requests)}


def time_command(path: Path, repeat: int) -> dict[str, Any]:
    walls = []
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    for _ in range(repeat):
        t0 = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "gpuhedge_celery", "report", str(path), "--json"],
            capture_output=True,
            env=env,
            check=False,
        )
        walls.append(time.perf_counter() - t0)
        if done.returncode != 0:
            raise click.ClickException(f"report failed: {done.stderr.decode()[-500:]}")
    return {"wall_s": round(min(walls), 3), "wall_s_runs": [round(w, 3) for w in walls]}


@click.command("report")
@shown(
    "--records",
    "n",
    type=click.IntRange(1),
    default=100_000,
    help="Requests in the synthetic file.",
)
@shown(
    "--gpuhedge-share",
    type=click.FloatRange(0, 1),
    default=0.1,
    help="Share of requests written in GPUHedge's live-record format.",
)
@shown(
    "--repeat",
    type=click.IntRange(1, 20),
    default=3,
    help="Timed runs of each kind (the best is reported).",
)
@shown("--seed", type=int, default=1)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the only format).")
def command(n: int, gpuhedge_share: float, repeat: int, seed: int, as_json: bool) -> None:
    """Time `report` over synthetic records (default 100,000; target under 2 s)."""
    with tempfile.TemporaryDirectory(prefix="gpuhedge-bench-report-") as tmp:
        path = Path(tmp) / "records.jsonl"
        size = write_records(path, n, gpuhedge_share, seed)
        in_process = time_in_process(path, repeat)
        cmd = time_command(path, repeat)
    result = {
        "records": n,
        "gpuhedge_share": gpuhedge_share,
        "file_mb": round(size / 2**20, 1),
        "in_process": in_process,
        "command": cmd,
        "target_s": TARGET_S,
        "meets_target": cmd["wall_s"] < TARGET_S,
        "cpus": os.cpu_count(),
        "what": "report FILE by policy: read + parse + summarise + format (in_process, best "
        "run); the whole command as a fresh process (command, interpreter start included)",
    }
    click.echo(json.dumps({"bench": "report", "results": [result]}))
