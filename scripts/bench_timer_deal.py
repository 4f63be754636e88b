#!/usr/bin/env python3
"""``bench timers`` on race shards, this tree against a baseline commit, alternating in one run:
what dealing the shards over coordinators (each shard claimed by one coordinator when there
are no more coordinators than shards) changes against every coordinator claiming every shard.

Per coordinator count (``--concurrency``) and pair, each side runs ``gpuhedge-celery bench
timers --json --timers N --shards S --threads T --concurrency C`` on a private redis-server of
its own (so ``redis_cpu_pct`` is the timers' alone): a row without a kill and one that SIGKILLs
a coordinator holding claims. The baseline is ``git archive <ref>`` unpacked in a temporary
folder and run with its own code.

Usage: ``PYTHONPATH=. python3 scripts/bench_timer_deal.py --ref <commit> [--timers 6000]
[--shards 3] [--threads 4] [--concurrency 1,2,3] [--pairs 2]``. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.redis_server import start_redis_server  # noqa: E402

KEEP = (
    "processes",
    "killed",
    "fired",
    "lost",
    "duplicates",
    "fired_by_process",
    "lag_p50_ms",
    "lag_p99_ms",
    "lag_max_ms",
    "lag_p99_ms_first_delivery",
    "redis_cpu_pct",
    "cpu_s_surviving_processes",
    "row_wall_s",
)


def _unpack(ref: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _side(tree: Path, args: argparse.Namespace, concurrency: int) -> list[dict]:
    server = start_redis_server()
    try:
        env = dict(os.environ, PYTHONPATH=str(tree))
        out = subprocess.run(
            [sys.executable, "-m", "gpuhedge_celery", "--redis-url",
             server.url, "bench", "timers", "--json", "--timers",
             str(args.timers), "--shards", str(args.shards), "--threads", str(args.threads),
             "--concurrency", str(concurrency), "--window", str(args.window)],
            cwd=tree, env=env, check=True, capture_output=True, text=True, timeout=600,
        ).stdout  # fmt: skip
    finally:
        server.stop()
    rows = json.loads(out[out.index("{") :])["results"]
    return [{key: row.get(key) for key in KEEP} for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", required=True, help="the baseline commit")
    parser.add_argument("--timers", type=int, default=6000)
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--concurrency", default="1,2,3")
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="gpuhedge-bench-deal-")
    try:
        baseline = _unpack(args.ref, Path(tempfile.mkdtemp(dir=workdir)))
        runs: list[dict[str, Any]] = []
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for pair in range(args.pairs):
                sides = [("baseline", baseline), ("this tree", ROOT)]
                for name, tree in sides if pair % 2 == 0 else sides[::-1]:
                    for row in _side(tree, args, concurrency):
                        runs.append({"side": name, "pair": pair, "concurrency": concurrency, **row})
                        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    setup = {k: v for k, v in vars(args).items()}
    print(json.dumps({"bench": "timer deal", "setup": setup, "cpus": os.cpu_count(),
                      "runs": runs}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
