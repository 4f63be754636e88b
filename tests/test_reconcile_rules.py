"""The reconcile rules as a table: Redis's view and the workers' reports in, corrections out."""

from __future__ import annotations

import pytest

from gpuhedge_celery.core.reconcile import (
    Action,
    GpuReport,
    GpuView,
    LeaseView,
    RunningJob,
    plan,
)

NOW = 1_000_000.0


def gpu(lease=None, *, live=True, silent=None, ttl_ms=30_000, gpu_id="h:0"):
    return GpuView(gpu_id, "default", "w0@h", live, silent, ttl_ms, lease)


def held(token=5, holder="task-a", age_s=60.0):
    return LeaseView(holder, token, NOW - age_s, 20_000)


def idle(gpu_id="h:0"):
    return {gpu_id: GpuReport(gpu_id)}


def busy(token=5, task="task-a", gpu_id="h:0"):
    return {gpu_id: GpuReport(gpu_id, (RunningJob(task, token, task, NOW - 30),))}


CASES = [
    # (name, views, reports, expected actions)
    ("free GPU, idle worker", [gpu()], idle(), []),
    ("held and running the same token", [gpu(held())], busy(), []),
    (
        "lease held on an idle GPU",
        [gpu(held())],
        idle(),
        [Action("free", "h:0", 5, "task-a", "lease held on idle GPU")],
    ),
    ("lease on idle GPU but younger than the grace", [gpu(held(age_s=2))], idle(), []),
    ("lease without a known start is left", [gpu(LeaseView("task-a", 5))], idle(), []),
    (
        "GPU busy without a lease",
        [gpu()],
        busy(token=7, task="task-b"),
        [Action("restore", "h:0", 7, "task-b", "GPU busy without a lease")],
    ),
    (
        "busy with two reported jobs: the newest token wins",
        [gpu()],
        {"h:0": GpuReport("h:0", (RunningJob("old", 3, "old"), RunningJob("new", 8, "new")))},
        [Action("restore", "h:0", 8, "new", "GPU busy without a lease")],
    ),
    (
        "lease and running job disagree: reported, not written",
        [gpu(held(token=9, holder="task-b"))],
        busy(token=5),
        [Action("conflict", "h:0", 9, "task-b", "worker runs token 5, lease has token 9")],
    ),
    ("worker did not answer: nothing changes", [gpu(held())], {}, []),
    ("worker did not answer, no lease", [gpu()], {}, []),
    ("dead host, lease younger than its TTL", [gpu(held(), live=False, silent=10)], {}, []),
    ("dead host, silence unknown", [gpu(held(), live=False, silent=None)], {}, []),
    (
        "dead host silent for a whole TTL",
        [gpu(held(), live=False, silent=30)],
        {},
        [Action("free", "h:0", 5, "task-a", "host stopped heartbeating")],
    ),
    ("dead host without a lease", [gpu(live=False, silent=99)], {}, []),
    (
        "dead host: a stale report is ignored",
        [gpu(held(), live=False, silent=1)],
        idle(),
        [],
    ),
]


@pytest.mark.parametrize("name, views, reports, expected", CASES, ids=[c[0] for c in CASES])
def test_rules(name, views, reports, expected):
    assert plan(views, reports, now=NOW, grace_s=10) == expected


def test_several_gpus_are_planned_independently_and_in_order():
    views = [gpu(held(), gpu_id="h:1"), gpu(gpu_id="h:0"), gpu(held(), gpu_id="h:2")]
    reports = {**idle("h:1"), **busy(token=3, task="t", gpu_id="h:0"), **busy(gpu_id="h:2")}
    kinds = [(a.kind, a.gpu_id) for a in plan(views, reports, now=NOW, grace_s=10)]
    assert kinds == [("restore", "h:0"), ("free", "h:1")]


def test_applying_the_plan_then_planning_again_is_a_no_op():
    """Idempotence: after the corrections, the same inputs with Redis fixed yield nothing."""
    reports = {**idle("h:1"), **busy(token=3, task="t", gpu_id="h:0")}
    before = [gpu(gpu_id="h:0"), gpu(held(), gpu_id="h:1")]
    assert len(plan(before, reports, now=NOW)) == 2
    after = [gpu(LeaseView("t", 3, NOW, 30_000), gpu_id="h:0"), gpu(gpu_id="h:1")]
    assert plan(after, reports, now=NOW) == []
