"""The soak: hedged races at a steady rate for a while, a random coordination worker
``kill -9``-ed every ``--kill-every`` seconds (a replacement started at once), and one Redis
``kill -9`` + restart with AOF half-way. Prints one JSON object with the counters:

* ``lost``: races whose caller's ``.get()`` neither returned nor raised RaceFailed;
* ``double_winners``: a result, receipt and winner claim that disagree;
* ``unflagged_leaks``: sim jobs still running at the end whose receipt does not list a leak;
* ``pooled_lost`` / ``double_gpu_holds``: with ``--gpus``, pooled jobs on real GPU workers (the
  ``python:`` runner of :func:`tests.support.faults.logged_run`, logging each run's GPU, lease
  token and times) at ``--gpu-rho`` of the GPUs' capacity: jobs that never returned, and pairs
  of runs of one GPU that overlapped or whose fencing token did not grow;
  a job still waiting in a backlog that drains is not lost: the count waits while jobs keep
  ending (``pooled_drain_s``: how long that took), until none has for 60 s;
  ``pooled_failed_lost_record`` counts apart the jobs Redis forgot together with their
  message (its ``kill -9`` drops the last second of writes): the caller's ``.get()`` raises
  ``RequestLost``, an explicit failure; ``pooled_resent``: jobs whose lost message a reconcile
  pass sent again (``tasks/pooled_sweep.py``); ``pooled_errors`` what each unfinished job ended
  with;
* ``worker_rss_mb`` / ``redis_used_mb``: samples over time (first, last, max, and every sample
  in ``series``, its columns named by ``series_fields``), to check both stay flat;
  ``redis_without_sim_mb`` leaves out the sim fake's per-job ledger (a day's TTL: test
  scaffolding); ``redis_growth_mb_per_min`` is the least-squares slope of Redis's memory
  without that ledger over the run's second half. Two product keys are bounded by design but
  take a while to level: finished races' keys (``--receipt-ttl`` shortens how long they stay,
  ``GPUHEDGE_RECEIPT_TTL_S``) and the race-record stream (capped at ``GPUHEDGE_RECORDS_MAXLEN``
  records; ``--records-maxlen`` lowers the cap so a short run reaches it);
  ``redis_memory_by_kind`` snapshots memory by kind of key at each quarter of the run;
  ``redis_keys`` says what Redis held at the end.

Run it with ``bash scripts/soak.sh`` (``--minutes 60`` for the full hour of traffic; the
default is a compressed ten minutes) on a private redis-server and private workers; the short
version runs in CI (tests/test_faults_soak.py). Loopback only; bounded in time and count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

from gpuhedge_celery.errors import RaceFailed
from gpuhedge_celery.store.pooled import PooledRecords
from gpuhedge_celery.store.race_keys import RaceShards
from gpuhedge_celery.tasks.pooled_result import send_pooled
from tests.support.faults import (
    HEDGED_REQUEST,
    RestartableRedis,
    double_holds,
    run_intervals,
    send_race,
    start_fault_cluster,
)
from tests.support.soak_memory import (
    SERIES_FIELDS,
    growth_per_min,
    key_census,
    memory_by_kind,
    memory_parts,
    memory_sample,
)

GPU_JOB_S = 1.0  # each pooled job's run on a GPU


POOL_ONLY = {"GPUHEDGE_COORD_QUEUES": "gpuhedge.pool"}


def soak(seconds: float, rate: float, kill_every_s: float, workers: int = 3,
         seed: int = 1, gpus: int = 0, gpu_rho: float = 0.5,
         receipt_ttl_s: float | None = None, sample_every_s: float = 5.0,
         pool_workers: int = 0, records_maxlen: int | None = None,
         reclaim_expired: bool = False) -> dict:  # fmt: skip
    """``pool_workers`` > 0 runs the pooled waits on that many workers of their own
    (``GPUHEDGE_COORD_QUEUES=gpuhedge.pool``) and the ``workers`` race coordinators without
    them; 0 runs everything on the ``workers`` coordinators (the default deployment)."""
    rng = random.Random(seed)
    redis = RestartableRedis(aof=True).start()
    tmp = Path(tempfile.mkdtemp(prefix="gpuhedge-soak-"))
    env = {} if receipt_ttl_s is None else {"GPUHEDGE_RECEIPT_TTL_S": f"{receipt_ttl_s:g}"}
    if records_maxlen is not None:
        env["GPUHEDGE_RECORDS_MAXLEN"] = str(records_maxlen)
    if pool_workers:
        env["GPUHEDGE_COORD_QUEUES"] = "gpuhedge.coord,gpuhedge.attempts"
    cluster = start_fault_cluster(redis.url, tmp, deadline_s=30.0, coordinators=workers,
                                  gpus=gpus, **env)  # fmt: skip
    waiters = {cluster.start_coordinator(**POOL_ONLY).pid for _ in range(pool_workers)}
    gpu_rate = gpu_rho * gpus / GPU_JOB_S  # pooled jobs per second
    pooled: list = []
    outcomes: dict[str, tuple[str, object]] = {}
    threads: list[threading.Thread] = []
    samples: list[tuple[float, ...]] = []  # SERIES_FIELDS
    latencies: list[tuple[float, float]] = []  # (sent at, s from start; send to result, s)
    by_kind: list[dict] = []
    kills = restarts = 0
    watch = PooledWatch(cluster).start()

    def wait(result, sent_at: float) -> None:
        try:
            outcomes[result.id] = ("won", result.get())
            latencies.append((sent_at - started, time.monotonic() - sent_at))
        except RaceFailed as e:
            outcomes[result.id] = ("failed", e)
        except Exception as e:  # a lost or broken race: counted
            outcomes[result.id] = (type(e).__name__, e)

    started = time.monotonic()
    try:
        next_kill = started + kill_every_s
        restart_at = started + seconds / 2
        snapshots = [started + seconds * q for q in (0.25, 0.5, 0.75)]  # memory by kind
        next_sample = started
        next_gpu_job = started
        sent = []
        while time.monotonic() - started < seconds:
            now = time.monotonic()
            while gpus and now >= next_gpu_job:
                job = {"id": f"j{len(pooled)}", "duration_s": GPU_JOB_S}
                try:
                    sent_job = send_pooled(cluster.app, job)  # recorded, as delay() does
                    pooled.append(sent_job)
                    watch.add(sent_job.id, time.monotonic())
                except Exception:  # Redis is restarting: sent again with the next one
                    pass
                next_gpu_job += rng.expovariate(gpu_rate)
            if now >= next_kill:
                alive = [w for w in cluster.workers if w.alive() and w.nodename.startswith("coord")]
                victim = rng.choice(alive) if alive else None
                if victim is not None:
                    victim.kill(signal.SIGKILL)
                    kills += 1
                if victim is not None and victim.pid in waiters:  # replaced by its own kind
                    waiters.add(cluster.start_coordinator(wait=False, **POOL_ONLY).pid)
                else:
                    cluster.start_coordinator(wait=False)
                next_kill += kill_every_s
            if restart_at is not None and now >= restart_at:
                redis.kill()
                redis.start()
                restarts += 1
                restart_at = None
            if snapshots and now >= snapshots[0]:
                snapshots.pop(0)
                with contextlib.suppress(Exception):
                    kinds = memory_by_kind(cluster.client)
                    by_kind.append({"at_s": round(now - started), "mb": kinds})
            if now >= next_sample:
                samples.append(memory_sample(cluster, round(now - started, 1), reclaim_expired))
                next_sample += sample_every_s
            try:
                result = send_race(cluster, HEDGED_REQUEST)
            except Exception:  # Redis is restarting: the caller sees the error at once
                time.sleep(0.2)
                continue
            sent.append(result)
            t = threading.Thread(target=wait, args=(result, time.monotonic()), daemon=True)
            t.start()
            threads.append(t)
            time.sleep(rng.expovariate(rate))
        for t in threads:
            t.join(30.0 + 10.0 + 30.0)
        counts = check(cluster, sent, outcomes)
        pooled_done = pooled_lost = pooled_forgotten = 0
        pooled_errors: dict[str, int] = {}  # what the lost pooled jobs ended with, by kind
        records = PooledRecords(cluster.client, cluster.store.keys)
        resent = resent_ids(cluster)
        for task_id, _sent, meta in watch.finish():
            if meta.get("status") == "SUCCESS":
                pooled_done += 1
                continue
            result = meta.get("result")
            kind = f"{meta.get('status', 'PENDING')}: {str(result)[:120]}"
            pooled_errors[kind] = pooled_errors.get(kind, 0) + 1
            if meta.get("status") is None and not records.known(task_id):
                # Redis lost the record with the message: the caller's .get() raises
                # RequestLost (tasks/pooled_result.py), an explicit failure
                pooled_forgotten += 1
            else:
                pooled_lost += 1
        runs = run_intervals(cluster.env["GPUHEDGE_TEST_RUN_LOG"])
        return {
            "seconds": seconds, "rate_per_s": rate, "races": len(sent), **counts,
            "pooled_jobs": len(pooled), "pooled_done": pooled_done, "pooled_lost": pooled_lost,
            "pooled_failed_lost_record": pooled_forgotten, "pooled_resent": len(resent),
            "pooled_drain_s": watch.drain_s,
            "pooled_errors": pooled_errors,
            "gpu_runs": sum(len(v) for v in runs.values()),
            "double_gpu_holds": len(double_holds(runs)),
            "gpus": gpus, "gpu_rho": gpu_rho if gpus else 0, "pool_workers": pool_workers,
            "receipt_ttl_s": receipt_ttl_s,
            "worker_kills": kills, "redis_restarts": restarts,
            "records_maxlen": records_maxlen,
            "worker_rss_mb": summary([s[1] for s in samples]),
            "redis_used_mb": summary([s[2] for s in samples]),
            "redis_without_sim_mb": summary([s[2] - s[3] for s in samples]),
            "redis_growth_mb_per_min": growth_per_min(samples),
            "redis_after_reclaim_mb": summary([s[9] for s in samples if s[9] > 0]),
            "redis_after_reclaim_growth_mb_per_min": growth_per_min(samples, column=9),
            "reclaim_expired": reclaim_expired,
            "race_latency_s_by_window": latency_windows(latencies, seconds),
            "series_fields": SERIES_FIELDS, "series": samples,
            "redis_keys": key_census(cluster.client),
            "redis_memory_by_kind": by_kind,
            "redis_memory_at_end": memory_parts(cluster.client),
        }  # fmt: skip
    finally:
        cluster.close()
        redis.close()


class PooledWatch:
    """Reads each pooled job's stored result (Celery's task meta) from Redis as it lands, in a
    thread, so the count at the end is right even when results expire soon after (a short
    ``--receipt-ttl`` also shortens Celery's ``result_expires``).

    Plain GETs rather than ``.get()``: Celery delivers results to callers by pub/sub, and a
    caller whose pub/sub connection gave up during the Redis restart ("Retry limit exceeded
    ... must be restarted") would count jobs that finished as lost.
    """

    def __init__(self, cluster):
        self.backend = cluster.app.backend
        self.pending: dict[str, float] = {}  # task id -> when it was sent
        self.metas: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.drain_s = 0.0  # how long the backlog took to drain after the traffic stopped

    def start(self) -> PooledWatch:
        self._thread.start()
        return self

    def add(self, task_id: str, sent_at: float) -> None:
        with self._lock:
            self.pending[task_id] = sent_at

    def _pass(self) -> None:
        with self._lock:
            ids = list(self.pending)
        for task_id in ids:
            try:
                meta = self.backend.get_task_meta(task_id)
            except Exception:  # Redis busy or restarting: looked at again on the next pass
                continue
            if meta.get("status") in ("SUCCESS", "FAILURE", "REVOKED"):
                with self._lock:
                    self.metas[task_id] = meta
                    self.pending.pop(task_id, None)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self._pass()

    def finish(self, idle_s: float = 60.0, cap_s: float = 900.0) -> list[tuple[float, dict]]:
        """Wait for the rest while they keep ending: until none has ended for ``idle_s`` (a
        backlog still draining is not a loss) or ``cap_s`` in all; (sent_at, meta) per job,
        meta ``{"status": None}`` for a job still not ended."""
        give_up = time.monotonic() + cap_s
        left, progress_at = len(self.pending), time.monotonic()
        while self.pending and time.monotonic() < give_up:
            time.sleep(0.5)
            if len(self.pending) < left:
                left, progress_at = len(self.pending), time.monotonic()
            elif time.monotonic() - progress_at >= idle_s:
                break
        self.drain_s = round(time.monotonic() - (give_up - cap_s), 1)
        self._stop.set()
        self._thread.join(10)
        self._pass()
        with self._lock:
            ended = [(task_id, 0.0, meta) for task_id, meta in self.metas.items()]
            return ended + [(task_id, sent, {"status": None})
                            for task_id, sent in self.pending.items()]  # fmt: skip


def resent_ids(cluster) -> set[str]:
    """Pooled requests a reconcile pass sent again after their message was lost (its log
    line, in the coordination workers' logs)."""
    import re

    found: set[str] = set()
    for path in Path(cluster.tmp_path).glob("coord*.log"):
        text = path.read_text(errors="replace")
        found.update(re.findall(r"pooled request ([0-9a-f-]{36}): its message was on no", text))
    return found


def latency_windows(latencies: list[tuple[float, float]], seconds: float) -> list[dict]:
    """Won races' send-to-result time (p50, p99, s) by sixth of the run, by when they were
    sent: a backlog building up shows as a rising latency."""
    width = seconds / 6
    rows = []
    for n in range(6):
        window = sorted(d for at, d in latencies if n * width <= at < (n + 1) * width)
        if window:
            rows.append(
                {
                    "from_s": round(n * width),
                    "races": len(window),
                    "p50": round(window[len(window) // 2], 2),
                    "p99": round(window[min(len(window) - 1, int(len(window) * 0.99))], 2),
                }
            )
    return rows  # fmt: skip


def summary(values: list[float]) -> dict:
    return {"first": values[0], "last": values[-1], "max": max(values)} if values else {}


def check(cluster, sent, outcomes) -> dict:
    from gpuhedge_celery.config import load_config
    from gpuhedge_celery.providers.redis_ledger import sim_job_running
    from gpuhedge_celery.providers.simledger import RedisLedger
    from gpuhedge_celery.store.races import RaceStore

    store = RaceStore(cluster.client, cluster.prefix)
    ledger = RedisLedger(cluster.client, cluster.prefix)
    cfg = load_config(cluster.env["GPUHEDGE_CONFIG"])
    lost = double = unflagged = won = failed = 0
    time.sleep(5)  # loser cancels still in flight settle
    for result in sent:
        kind, value = outcomes.get(result.id, ("lost", None))
        if kind == "won":
            won += 1
        elif kind == "failed":
            failed += 1
        else:
            lost += 1
            continue
        receipt = store.receipt(result.id) or {}
        winner = cluster.client.get(RaceShards(cluster.prefix).race(result.id).winner)
        if kind == "won" and not (value["attempt"] == receipt.get("winner", value["attempt"])
                                  == (winner or value["attempt"])):  # fmt: skip
            double += 1
        flagged = {leak.get("job_id") for leak in receipt.get("leaks") or []}
        for attempt in receipt.get("attempts") or []:
            handle = attempt.get("handle")
            if handle:
                provider = cfg.build(attempt["provider"], ledger=ledger)
                if sim_job_running(provider, handle) and attempt["job_id"] not in flagged:
                    unflagged += 1
    return {"won": won, "failed_explicitly": failed, "lost": lost, "double_winners": double,
            "unflagged_leaks": unflagged}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the run")
    parser.add_argument("--rate", type=float, default=8.0, help="races started per second")
    parser.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills")
    parser.add_argument("--gpus", type=int, default=2, help="GPU workers running pooled jobs")
    parser.add_argument("--gpu-rho", type=float, default=0.5,
                        help="pooled load as a fraction of the GPUs' capacity")  # fmt: skip
    parser.add_argument(
        "--receipt-ttl",
        type=float,
        default=None,
        help="GPUHEDGE_RECEIPT_TTL_S for the workers (default: theirs, 1 day)",
    )
    parser.add_argument("--sample-every", type=float, default=15.0, help="seconds per sample")
    parser.add_argument("--pool-workers", type=int, default=0,
                        help="run pooled waits on this many workers of their own")  # fmt: skip
    parser.add_argument("--records-maxlen", type=int, default=None,
                        help="GPUHEDGE_RECORDS_MAXLEN for the workers")  # fmt: skip
    parser.add_argument("--reclaim-expired", action="store_true",
                        help="each sample also SCANs the keyspace (reclaiming expired keys) "
                        "and reads Redis's memory again")  # fmt: skip
    args = parser.parse_args()
    print(json.dumps(soak(args.minutes * 60, args.rate, args.kill_every, gpus=args.gpus,
                          gpu_rho=args.gpu_rho, receipt_ttl_s=args.receipt_ttl,
                          sample_every_s=args.sample_every,
                          pool_workers=args.pool_workers,
                          records_maxlen=args.records_maxlen,
                          reclaim_expired=args.reclaim_expired)))  # fmt: skip


if __name__ == "__main__":
    main()
