"""Every Celery queue and task name of the package, in one place.

Other Celery apps call the tasks by these names and route them to these queues, so they are
part of the interface, as are the names of GPU pools they send jobs to (one rule, below, for
the environment, the config file, task arguments and the store). Redis key names live in
:mod:`gpuhedge_celery.store.keys` (leases, the pool, the glue's own keys) and
:mod:`gpuhedge_celery.store.race_keys` (races, timers, the budget ledger).
``tests/test_names.py`` fails when a name is spelled out anywhere else.
"""

from __future__ import annotations

import re

# -- queues ----------------------------------------------------------------------------------
QUEUE_COORD = "gpuhedge.coord"  # races (hedged_infer, race_step), reconcile, the janitor
QUEUE_ATTEMPTS = "gpuhedge.attempts"  # race_submit, race_cancel
QUEUE_POOL = "gpuhedge.pool"  # pooled_infer: requests waiting for a GPU of a pool
GPU_QUEUE_PREFIX = "gpuhedge.gpu."  # + a GPU id: the queue of that GPU's worker
COORD_QUEUES = (QUEUE_COORD, QUEUE_ATTEMPTS, QUEUE_POOL)  # what a coordination worker consumes


def gpu_queue(gpu_id: str) -> str:
    """The queue only the worker of GPU ``gpu_id`` consumes."""
    return f"{GPU_QUEUE_PREFIX}{gpu_id}"


# -- tasks -----------------------------------------------------------------------------------
TASK_PREFIX = "gpuhedge."  # every task of the package
TASK_HEDGED_INFER = "gpuhedge.hedged_infer"
TASK_RACE_SUBMIT = "gpuhedge.race_submit"
TASK_RACE_CANCEL = "gpuhedge.race_cancel"
TASK_RACE_STEP = "gpuhedge.race_step"
TASK_POOLED_INFER = "gpuhedge.pooled_infer"
TASK_GPU_RUN = "gpuhedge.gpu_run"
TASK_RECONCILE = "gpuhedge.reconcile"
TASK_JANITOR = "gpuhedge.janitor"
TASK_BENCH_CELERY_FLOOR = "gpuhedge.bench.celery_floor"  # bench/celery_floor.py's plugin task
# the race tasks: idempotent, a rerun resumes its race
RACE_TASKS = frozenset({TASK_HEDGED_INFER, TASK_RACE_STEP, TASK_RACE_SUBMIT, TASK_RACE_CANCEL})


# -- GPU pools -------------------------------------------------------------------------------
# A pool's name sits inside a Redis Cluster hash tag (braces would break it), between ':'
# separators of key names, and in metric labels; whitespace is unreadable in redis-cli.
_POOL_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}\Z")
POOL_NAME_RULE = "1-200 letters, digits, '_', '-' or '.'"


def pool_name_problem(name: object) -> str | None:
    """Why ``name`` cannot name a GPU pool, in one line; None when it can."""
    if isinstance(name, str) and _POOL_RE.match(name):
        return None
    return f"invalid pool name {name!r}: expected {POOL_NAME_RULE}"
