"""Every Redis key and channel name the lease store and the Celery glue use, in one place.

All names live under one configurable prefix so several deployments (or test runs) can share a
Redis without seeing each other's keys. The keys of races, timers and the budget ledger are in
:mod:`.race_keys`; Celery's queue and task names in :mod:`gpuhedge_celery.names`
(``tests/test_names.py`` fails when a key is built anywhere else).
"""

from __future__ import annotations

from ..names import pool_name_problem

LEASE_SEGMENT = "lease"


def check_pool(pool: str) -> str:
    """Return ``pool`` if it may name a pool (:func:`~gpuhedge_celery.names.pool_name_problem`),
    else raise ``ValueError``."""
    problem = pool_name_problem(pool)
    if problem is not None:
        raise ValueError(problem)
    return pool


def pool_tag(pool: str) -> str:
    """The Redis Cluster hash tag every key of ``pool`` carries, so one script may touch the
    pool's queue and all its GPUs' leases and Cluster keeps them on one slot."""
    return "{pool:" + check_pool(pool) + "}"


def under(prefix: str, name: str) -> str:
    """``name`` under ``prefix`` (``<prefix>:<name>``): how every key of a deployment is named."""
    return f"{prefix}:{name}"


def all_keys(prefix: str) -> str:
    """The SCAN pattern of every key under ``prefix`` (clean-ups and memory counts)."""
    return under(prefix, "*")


class Keys:
    """Builds the key names of one deployment (one prefix)."""

    def __init__(self, prefix: str = "gpuhedge"):
        if not prefix:
            raise ValueError("key prefix must not be empty")
        self.prefix = prefix

    def _k(self, *parts: str) -> str:
        return under(self.prefix, ":".join(parts))

    # -- one pool: every key below carries the pool's hash tag ---------------------------------
    def _p(self, pool: str, *parts: str) -> str:
        return under(self.prefix, ":".join((pool_tag(pool), *parts)))

    def lease(self, pool: str, gpu_id: str) -> str:
        """String ``token|since_ms|holder`` with a PX TTL: present while the GPU is held."""
        return self._p(pool, LEASE_SEGMENT, gpu_id)

    def fence(self, pool: str, gpu_id: str) -> str:
        """Integer counter: the last fencing token issued for the GPU (INCR, never reset)."""
        return self._p(pool, "fence", gpu_id)

    def accepted(self, pool: str, gpu_id: str) -> str:
        """Integer: the highest fencing token the GPU's worker has accepted (check_fence)."""
        return self._p(pool, "accepted", gpu_id)

    def out(self, pool: str, gpu_id: str) -> str:
        """Hash reason -> ``since_ms|detail``: present while the GPU takes no new lease (drained by
        an operator, faulted, unhealthy, its model not loaded). The claim scripts read it."""
        return self._p(pool, "out", gpu_id)

    def health(self, pool: str, gpu_id: str) -> str:
        """String (JSON, PX TTL): the GPU's last health sample, written by its worker."""
        return self._p(pool, "health", gpu_id)

    def gpu(self, pool: str, gpu_id: str) -> str:
        """Hash: pool, host, labels (JSON) of one GPU registered in the pool."""
        return self._p(pool, "gpu", gpu_id)

    def running(self, pool: str, gpu_id: str) -> str:
        """What the GPU's worker reports running (owned by the Celery glue)."""
        return self._p(pool, "running", gpu_id)

    def pool_gpus(self, pool: str) -> str:
        """Set of the GPU ids registered in a pool."""
        return self._p(pool, "gpus")

    def pool_ttl(self, pool: str) -> str:
        """Integer: the pool's lease TTL in ms (absent: the default)."""
        return self._p(pool, "ttl")

    def pool_host(self, pool: str, host: str) -> str:
        """A host's heartbeat as the pool sees it: present (with a PX TTL) while the host, which
        has GPUs in the pool, is alive (``LeaseStore.host_heartbeat`` writes one per pool)."""
        return self._p(pool, "host", host)

    def durations(self, pool: str) -> str:
        """List of recent job durations (seconds, newest first) for TTL suggestions."""
        return self._p(pool, "durations")

    def waiters(self, pool: str) -> str:
        """Sorted set holder -> arrival number: the pool's FIFO wait queue."""
        return self._p(pool, "waiters")

    def waitinfo(self, pool: str) -> str:
        """Hash holder -> ``expires_at_ms|gpu,gpu,...``: liveness and GPU filter of each waiter."""
        return self._p(pool, "waitinfo")

    def waitseq(self, pool: str) -> str:
        """Integer counter giving waiters their arrival numbers."""
        return self._p(pool, "waitseq")

    def freeat(self, pool: str) -> str:
        """Hash gpu -> ``fence|ms``: when waiters of the pool first saw the GPU free (server ms)."""
        return self._p(pool, "freeat")

    def procs(self, pool: str) -> str:
        """Sorted set process id -> last heartbeat (server ms): liveness of the processes that
        wait on (or took a pooled request of) the pool, beside the pool's queue."""
        return self._p(pool, "procs")

    def stop(self, pool: str, task_id: str) -> str:
        """The stop flag of one pooled request of the pool (``tasks/cancel.py``)."""
        return self._p(pool, "stop", task_id)

    def pooled(self, pool: str, request_id: str) -> str:
        """Hash: a pooled request's record (arguments, state, taker; ``store/pooled.py``)."""
        return self._p(pool, "pooled", request_id)

    def pooled_unseen(self, pool: str) -> str:
        """Sorted set request id -> sent (epoch ms): pooled requests no worker has taken."""
        return self._p(pool, "pooled-unseen")

    def pooled_taken(self, pool: str) -> str:
        """Sorted set request id -> taken (server ms): pooled requests waiting for a GPU."""
        return self._p(pool, "pooled-taken")

    def pooled_handed(self, pool: str) -> str:
        """Sorted set request id -> handed (server ms): pooled requests handed to a GPU."""
        return self._p(pool, "pooled-handed")

    def pooled_missing(self, pool: str) -> str:
        """Sorted set request id -> when a sweep first found its broker message missing."""
        return self._p(pool, "pooled-missing")

    # -- registry hints (each on its own slot, never in a script with a pool's keys) ----------
    def gpu_pools(self) -> str:
        """Hash gpu id -> pool of every registered GPU: how a GPU id finds its pool's keys."""
        return self._k("gpu-pools")

    def pools(self) -> str:
        """Set of pool names."""
        return self._k("pools")

    def host_pools(self, host: str) -> str:
        """Set of the pools a host has GPUs in (its heartbeat goes to each)."""
        return self._k("host", host, "pools")

    def host_gpus(self, host: str) -> str:
        """Set of the GPU ids owned by a host."""
        return self._k("host", host, "gpus")

    def pooled_pools(self) -> str:
        """Set of the pools that had a pooled request (the sweep goes over each)."""
        return self._k("pooled-pools")

    # -- process-wide -------------------------------------------------------------------------
    def proc_channel(self, process_id: str = "") -> str:
        """Pub/sub channel a waiting process stays subscribed to while it lives (nothing is
        published on it: Redis drops the subscription the moment the process's socket closes)."""
        return self._k("proc", process_id)

    def wake_channel(self) -> str:
        """Pub/sub channel (message: pool) published when a queue change may let a waiter in."""
        return self._k("wake")

    def reconcile_lock(self) -> str:
        """Short lock so two reconcile passes never run at once."""
        return self._k("reconcile", "lock")

    def dead_since(self) -> str:
        """Hash host -> epoch ms when a reconcile pass first saw the host without a heartbeat."""
        return self._k("reconcile", "dead_since")

    def janitor_lock(self) -> str:
        """Short lock so two janitor passes never run at once."""
        return self._k("janitor", "lock")

    # -- benchmarks (bench/handoff.py) ------------------------------------------------------
    def bench_poll(self) -> str:
        """The key a benchmark's poller process watches."""
        return self._k("bench", "poll")

    def bench_background(self, index: int) -> str:
        """One of the volatile background keys a benchmark fills Redis with."""
        return self._k("bench", "bg", str(index))

    # -- provider request budgets -----------------------------------------------------------
    def rate_bucket(self, scope: str, route: str) -> str:
        """Hash ``tokens``, ``ts``: one provider route's token bucket, shared by every process
        (``providers/ratelimit.py``; ``scope`` names the endpoint, e.g. ``runpod:<id>``)."""
        return self._k("ratelimit", f"{{{scope}}}", route)

    # -- adaptive policies ------------------------------------------------------------------
    def adaptive_seen(self, policy: str) -> str:
        """Stream of JSON observations (``o``): what each finished race of an adaptive policy
        saw of its jobs, read by every coordinator's learner (``store/adaptive.py``)."""
        return self._k("adaptive", f"{{{policy}}}", "seen")

    def adaptive_counts(self, policy: str) -> str:
        """Hash ``seq`` (requests planned), ``tokens`` (the hedge budget's bucket), ``reset``
        (a count bumped by ``policy reset``) and ``plan`` (JSON: the last plan a coordinator
        fitted, what ``policy show`` and the metrics read) of an adaptive policy."""
        return self._k("adaptive", f"{{{policy}}}", "counts")

    def adaptive_took(self, policy: str, key: str) -> str:
        """String set once a race and role (``key``) spent one of the policy's hedge tokens,
        so a step applied again spends no second one (kept an hour)."""
        return self._k("adaptive", f"{{{policy}}}", "took", key)

    def adaptive_policies(self) -> str:
        """Set of the adaptive policy names that planned a request (for the metrics)."""
        return self._k("adaptive", "policies")

    # -- provider accounts ------------------------------------------------------------------
    def balance_snapshots(self, provider: str) -> str:
        """Sorted set of JSON ``{at, usd, account}`` by epoch s: a provider's account balance
        as ``costs`` read it (RunPod reports a balance, not spend: the drop is the spend)."""
        return self._k("balance", provider)
