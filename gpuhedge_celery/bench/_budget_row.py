"""The ``budget`` row of ``gpuhedge-celery bench races``: CPU per race with budgets on vs off.

The same hedged races (primary and hedge both submitted: two reservations and two settlements
per race, the most a two-attempt race costs the budget) run on fresh workers and a fresh
private Redis with the benchmark's config, once without a ``budget:`` block (budgets off) and
once with one whose caps are high enough never to refuse (budgets on), in alternating pairs
(off, on, off, on...) so that drift of the machine's speed hits both sides alike. Per side:
CPU of the workers, Redis and this client per race, Redis commands per race and ``EVALSHA``
calls per race. Round trips are not counted here: the reservation rides in the submit claim's
pipeline and each settlement in the step's save (``tests/test_budget_round_trips.py`` counts them).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from ..store.race_keys import budget_keys

# caps no race here can reach: every reservation is made and settled, none refused
BUDGET = """
budget:
  max_usd_per_request: 100
  max_usd_per_day: 1000000
  ceiling_usd: 1000000
  providers: {p: {max_usd_per_day: 1000000}}
"""
SCALE = 0.01  # a provider second is 10 ms
# both jobs run 10 provider s (100 ms); the hedge launches 1 ms after the primary's submit
REQUEST = {"sim": {"p": {"queue_s": 0.5, "run_s": 10}, "h": {"queue_s": 0.2, "run_s": 9}}}
POLICY = "hedge:p->h@0.001s"


def _stats(bench: Any) -> tuple[int, int, int]:
    """Commands processed, ``EVALSHA`` calls and budget ledger entries so far."""
    info = bench.client.info("stats")
    calls = bench.client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    ledger = bench.client.xlen(budget_keys(bench.prefix).ledger)
    return int(info["total_commands_processed"]), int(calls), int(ledger)


class Tools:
    """What the row borrows from ``bench/races.py`` (handed in: that module imports this one)."""

    def __init__(
        self,
        cluster: Callable[..., Any],
        cpu_s: Callable[[int], float],
        wait_receipt: Callable[[Any, str, float], dict],
    ):
        self.cluster, self.cpu_s, self.wait_receipt = cluster, cpu_s, wait_receipt


def _side(
    tools: Tools, url: str | None, workers: int, concurrency: int, races: int, on: bool
) -> dict:
    _cpu_s, _wait_receipt = tools.cpu_s, tools.wait_receipt
    with tools.cluster(
        url, workers, concurrency, SCALE, extra_config=BUDGET if on else ""
    ) as bench:
        for _ in range(20):  # warm the workers (imports, connections, scripts)
            bench.send(REQUEST, policy=POLICY).get(timeout=60)
        time.sleep(0.5)  # let the warm-up races' losers finish their cancels
        pids = bench.worker_pids()
        cmds0, evalsha0, ledger0 = _stats(bench)
        workers0, redis0 = sum(_cpu_s(p) for p in pids), bench.redis_cpu_s()
        me0 = time.process_time()
        t0 = time.perf_counter()
        ids = []
        for i in range(races):  # paced: ~100 races a second, well inside capacity
            ids.append(bench.send(REQUEST, policy=POLICY).id)
            pause = t0 + (i + 1) / 100.0 - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
        receipts = [_wait_receipt(bench, race_id, 120) for race_id in ids]
        time.sleep(0.5)  # the last losers' cancels and settlements
        parts = {
            "workers": sum(_cpu_s(p) for p in pids) - workers0,
            "redis": bench.redis_cpu_s() - redis0,
            "client": time.process_time() - me0,
        }
        cmds1, evalsha1, ledger1 = _stats(bench)
        open_left = bench.client.zcard(budget_keys(bench.prefix).open)
    submitted = sum(1 for r in receipts for a in r["attempts"] if a.get("handle"))
    return {
        "budgets": "on" if on else "off",
        "races": races,
        "submits_per_race": round(submitted / races, 3),
        "won": sum(1 for r in receipts if r.get("winner")),
        "cpu_ms_per_race": round(1000.0 * sum(parts.values()) / races, 3),
        "cpu_ms_per_race_by": {k: round(1000.0 * v / races, 3) for k, v in parts.items()},
        "redis_commands_per_race": round((cmds1 - cmds0) / races, 2),
        "evalsha_per_race": round((evalsha1 - evalsha0) / races, 2),
        # reservations, refusals and settlements the ledger recorded (0 with budgets off)
        "ledger_entries_per_race": round((ledger1 - ledger0) / races, 2),
        "open_reservations_left": int(open_left),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def budget_row(
    tools: Tools, url: str | None, workers: int, concurrency: int, races: int, pairs: int
) -> dict[str, Any]:
    """``pairs`` alternating off/on runs of ``races`` hedged races; the comparison."""
    runs = []
    for _ in range(pairs):
        runs.append(_side(tools, url, workers, concurrency, races, on=False))
        runs.append(_side(tools, url, workers, concurrency, races, on=True))
    off = [r["cpu_ms_per_race"] for r in runs if r["budgets"] == "off"]
    on = [r["cpu_ms_per_race"] for r in runs if r["budgets"] == "on"]
    per_pair = [100.0 * (b - a) / a for a, b in zip(off, on, strict=True)]
    commands = {
        side: statistics.median(r["redis_commands_per_race"] for r in runs if r["budgets"] == side)
        for side in ("off", "on")
    }
    return {
        "row": "budget",
        "runs": runs,
        "cpu_ms_per_race_off": round(statistics.median(off), 3),
        "cpu_ms_per_race_on": round(statistics.median(on), 3),
        "cpu_delta_pct_per_pair": [round(x, 1) for x in per_pair],
        "cpu_delta_pct": round(statistics.median(per_pair), 1),
        # script-internal commands included: the reserve and settle scripts' HINCRBYs, XADDs
        "redis_commands_per_race_delta": round(commands["on"] - commands["off"], 2),
        "what": "hedged races (2 submits each) on fresh workers and Redis, budgets off vs on, "
        "alternating pairs; CPU = workers + Redis + client",
    }
