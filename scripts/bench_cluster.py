#!/usr/bin/env python3
"""The race capacity row (``bench races``' ``capacity``) with the store on one Redis and on a
local Redis Cluster, alternating, in one run: how the Redis CPU of a race spreads over the
cluster's primaries.

Each pair runs the same races (same seed) twice on fresh workers: once with the store on a
private single ``redis-server`` (one race shard, the default there), once on a private
three-master cluster on loopback (``tests/support/redis_cluster.py``) with
``GPUHEDGE_RACE_SHARDS`` shards, Celery's broker and results on a plain ``redis-server`` of
their own (as a cluster store requires). Per side it prints the capacity row's own fields and:

* ``redis_cpu_ms_per_race``: Redis CPU per race summed over the store's primaries;
* ``redis_cpu_ms_per_race_by_node`` and ``redis_busiest_node_share`` (busiest / sum);
* per pair, ``summed_cpu_vs_single``: the cluster's summed Redis CPU per race over the single
  node's, and ``projected_capacity_vs_single``: how many times the single node's races/s the
  cluster carries before its busiest primary is as busy as the single node would be (single
  node CPU per race / busiest primary's CPU per race).

Usage: ``PYTHONPATH=. python3 scripts/bench_cluster.py [--races 600] [--duration-s 10]
[--pairs 2] [--shards 3] [--masters 3]``. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpuhedge_celery.bench.race_capacity import capacity_row  # noqa: E402
from gpuhedge_celery.bench.races import bench_cluster  # noqa: E402
from gpuhedge_celery.envvars import CLUSTER_RACE_SHARDS  # noqa: E402
from tests.support.redis_cluster import LocalCluster  # noqa: E402
from tests.support.redis_server import start_redis_server  # noqa: E402


def _side(args: argparse.Namespace, cluster: LocalCluster | None, broker: str | None) -> dict:
    scale = args.duration_s / 30.0
    env = {"GPUHEDGE_RACE_SHARDS": str(args.shards if cluster else 1)}
    if cluster is not None and broker is not None:
        env["GPUHEDGE_BROKER_URL"] = broker
    url = cluster.url if cluster is not None else None
    with bench_cluster(url, args.workers, args.concurrency, scale, extra_env=env) as bench:
        row = capacity_row(bench, args.races, scale, args.seed, args.ramp_s)
    by_node = row["redis_cpu_ms_per_race_by_node"]
    row["store"] = f"cluster of {len(by_node)} primaries" if cluster else "one redis-server"
    row["race_shards"] = int(env["GPUHEDGE_RACE_SHARDS"])
    row["redis_cpu_ms_per_race"] = round(sum(by_node), 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--races", type=int, default=600)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--ramp-s", type=float, default=None)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--shards", type=int, default=CLUSTER_RACE_SHARDS)
    parser.add_argument("--masters", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    broker_server = start_redis_server()  # Celery's broker and results
    broker = broker_server.url
    pairs: list[dict[str, Any]] = []
    try:
        for _ in range(args.pairs):
            single = _side(args, None, None)
            with LocalCluster(masters=args.masters) as cluster:
                clustered = _side(args, cluster, broker)
            one = single["redis_cpu_ms_per_race"]
            busiest = max(clustered["redis_cpu_ms_per_race_by_node"])
            pairs.append(
                {
                    "single": single,
                    "cluster": clustered,
                    "summed_cpu_vs_single": round(clustered["redis_cpu_ms_per_race"] / one, 3),
                    "projected_capacity_vs_single": round(one / busiest, 2) if busiest else None,
                }
            )
    finally:
        broker_server.stop()
    summary = {
        key: statistics.median(p[key] for p in pairs)
        for key in ("summed_cpu_vs_single", "projected_capacity_vs_single")
        if all(p[key] is not None for p in pairs)
    }
    summary["busiest_node_share"] = statistics.median(
        p["cluster"]["redis_busiest_node_share"] for p in pairs
    )
    summary["every_race_won"] = all(
        p[side]["won"] == p[side]["races"] for p in pairs for side in ("single", "cluster")
    )
    summary["leaks"] = sum(p[side]["leaks"] for p in pairs for side in ("single", "cluster"))
    out = {
        "bench": "cluster capacity",
        "args": vars(args),
        "cpus": os.cpu_count(),
        "median": summary,
        "pairs": pairs,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
