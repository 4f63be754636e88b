"""Race overhead and capacity with the network between workers and Redis slowed down.

Every worker, beat-less, and the benchmark's own client reach a private ``redis-server``
through the loopback proxy of :mod:`tests.support.netproxy`, adding a fixed delay (plus jitter)
to each direction of every connection; the ``direct`` level skips the proxy and ``0 ms`` measures
the proxy alone. Per level it runs ``gpuhedge-celery bench races``' own rows
(:mod:`gpuhedge_celery.bench.races`): ``overhead`` (zero-latency races one at a time: client
time minus the provider's, p50/p99, beside a trivial Celery round trip) and ``capacity`` (races
started over a ramp with compressed 5-30 s jobs: how many finished, timer lag, CPU). Prints
one JSON object; docs/benchmarks.md and docs/reliability.md quote it.

    PYTHONPATH=. python -m tests.support.netbench [--overhead-races N] [--capacity-races N]
"""

from __future__ import annotations

import argparse
import json
import time

from gpuhedge_celery.bench.races import bench_cluster, capacity_row, overhead_rows
from tests.support.faults import RestartableRedis
from tests.support.netproxy import NetProxy

LEVELS = [("direct", None, 0.0), ("proxy 0 ms", 0.0, 0.0), ("5 ms", 0.005, 0.001),
          ("50 ms", 0.050, 0.005)]  # fmt: skip


def level(name: str, delay_s: float | None, jitter_s: float, args) -> dict:
    server = RestartableRedis().start()
    proxy = None
    try:
        url = server.url
        if delay_s is not None:
            proxy = NetProxy("127.0.0.1", server.port, latency_s=delay_s, jitter_s=jitter_s,
                             seed=1).start()  # fmt: skip
            url = proxy.url_for(server.url)
        scale = args.duration_s / 30.0
        started = time.monotonic()
        with bench_cluster(url, args.workers, args.concurrency, scale) as bench:
            race, trip = overhead_rows(bench, args.overhead_races)
            cap = capacity_row(bench, args.capacity_races, scale, seed=1, ramp_s=args.ramp_s)
        return {
            "level": name, "added_delay_ms_each_way": None if delay_s is None else delay_s * 1e3,
            "jitter_ms": jitter_s * 1e3,
            "overhead_ms": {k: race[k] for k in ("p50_ms", "p99_ms", "n")},
            "celery_roundtrip_ms": {k: trip[k] for k in ("p50_ms", "p99_ms")},
            "capacity": {k: cap[k] for k in ("races", "finished", "won", "concurrent_peak",
                                             "timer_lag_ms", "watch_lag_ms", "wall_s",
                                             "cpu_ms_per_race", "leaks")},
            "redis_ping_p50_ms": cap["redis_ping_p50_ms"],
            "level_wall_s": round(time.monotonic() - started, 1),
        }  # fmt: skip
    finally:
        if proxy is not None:
            proxy.close()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overhead-races", type=int, default=100)
    parser.add_argument("--capacity-races", type=int, default=200)
    parser.add_argument("--duration-s", type=float, default=10.0,
                        help="real seconds of the longest capacity job")  # fmt: skip
    parser.add_argument("--ramp-s", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--levels", default="direct,proxy 0 ms,5 ms,50 ms")
    args = parser.parse_args()
    wanted = [w.strip() for w in args.levels.split(",")]
    rows = [level(n, d, j, args) for n, d, j in LEVELS if n in wanted]
    print(json.dumps({"bench": "network", "setup": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
