"""Both metric endpoints on real Celery workers, scraped over HTTP, and by a real Prometheus.

One cluster for the module: a coordination worker (threads pool) running races on sim
providers and pooled waits, two GPU workers (prefork, one child each: their jobs' metrics are
counted in the child and served by the main process, multiprocess mode), each with its own
``GPUHEDGE_METRICS_PORT``, and ``gpuhedge-celery metrics serve`` reading Redis. Tests compare
the counters before and after what they do, so their order does not matter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from tests.support.fixtures_celery import CeleryCluster
from tests.support.fixtures_races import RACE_CONFIG, REPO
from tests.support.prometheus_server import (
    sample,
    scrape,
    start_prometheus,
    wait_for_endpoint,
)
from tests.support.redis_server import free_port
from tests.test_metrics_deploy import dashboard_queries

pytestmark = [pytest.mark.celery, pytest.mark.slow, pytest.mark.timeout(150)]

FAST = {"sim": {"p": {"queue_s": 0, "run_s": 0}}}
# The primary would run 100 provider seconds (1 s real); the hedge, launched 0.2 s after the
# primary's submit, answers at once and wins; the primary is cancelled.
HEDGED = {"sim": {"p": {"queue_s": 0, "run_s": 100}, "h": {"queue_s": 0, "run_s": 0}}}
HEDGE_POLICY = "hedge:p->h@0.2s"


class MetricsCluster:
    def __init__(self, redis_url: str, tmp, broker_url: str | None = None) -> None:
        config = tmp / "races.yaml"
        config.write_text(RACE_CONFIG)
        self.prefix = f"t{uuid.uuid4().hex[:10]}"
        self.cluster = CeleryCluster(redis_url, self.prefix, tmp, broker_url)
        self.cluster.env.update({"GPUHEDGE_CONFIG": str(config), "PYTHONPATH": str(REPO),
                                 "GPUHEDGE_METRICS_ADDR": "127.0.0.1"})  # fmt: skip
        self.ports = {name: free_port() for name in ("coord", "gpu0", "gpu1", "serve")}

        def metrics_env(name: str) -> dict[str, str]:  # each GPU worker its port and directory
            return {"GPUHEDGE_METRICS_PORT": str(self.ports[name]),
                    "PROMETHEUS_MULTIPROC_DIR": str(tmp / f"prom-{name}")}  # fmt: skip

        # the coordinator (threads pool, one process) counts in memory: no directory
        coord = {"GPUHEDGE_METRICS_PORT": str(self.ports["coord"])}
        started = [
            self.cluster.start_coordinator(wait=False, **coord),
            self.cluster.start_gpu(0, wait=False, **metrics_env("gpu0")),
            self.cluster.start_gpu(1, wait=False, **metrics_env("gpu1")),
        ]
        self.serve = subprocess.Popen(
            [sys.executable, "-m", "gpuhedge_celery", "metrics", "serve", "--addr", "127.0.0.1",
             "--port", str(self.ports["serve"])],
            env=self.cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        self.cluster.wait_ready(*started)
        self.app = self.cluster.app
        for name in self.ports:
            wait_for_endpoint(self.ports[name])

    def race(self, request, **kwargs):
        return self.app.send_task("gpuhedge.hedged_infer", (request,), kwargs,
                                  queue="gpuhedge.coord")  # fmt: skip

    def pooled(self, seconds: float):
        return self.app.send_task("gpuhedge.pooled_infer", ({"duration_s": seconds},),
                                  {"pool": "default"})  # fmt: skip

    def scrape(self, name: str):
        return scrape(self.ports[name])

    def close(self) -> None:
        self.serve.kill()
        self.serve.wait(10)
        self.cluster.close()


@pytest.fixture(scope="module")
def metrics_cluster(redis_url, tmp_path_factory, broker, request):
    from gpuhedge_celery.store.connection import redis_from_url
    from gpuhedge_celery.store.listener import enable_notifications
    from tests.support.fixtures_celery import broker_url_for

    enable_notifications(redis_from_url(redis_url))
    broker_url = broker_url_for(broker, request)
    mc = MetricsCluster(redis_url, tmp_path_factory.mktemp("metrics"), broker_url)
    yield mc
    mc.close()
    client = redis_from_url(redis_url)
    keys = list(client.scan_iter(f"{mc.prefix}:*", count=1000))
    if keys:
        client.delete(*keys)


def _handoffs(mc) -> float:
    return sum(
        sample(mc.scrape(g), "gpuhedge_pool_handoff_seconds_count", pool="default")
        for g in ("gpu0", "gpu1")
    )


def test_worker_endpoints_count_what_ran_and_serve_reads_redis(metrics_cluster):
    mc = metrics_cluster
    before, handoffs = mc.scrape("coord"), _handoffs(mc)
    races = [mc.race(FAST)] + [mc.race(HEDGED, policy=HEDGE_POLICY) for _ in range(2)]
    jobs = [mc.pooled(0.3), mc.pooled(0.3)]
    winners = [r.get(timeout=30)["winner"] for r in races]
    assert winners == ["p", "h", "h"]
    assert all(j.get(timeout=30)["pool"] == "default" for j in jobs)

    def grew(after, name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    deadline = time.monotonic() + 10  # the losers' cancels finish after the winners' results
    while True:
        after = mc.scrape("coord")
        cancelled = grew(after, "gpuhedge_race_losers_cancelled_total", provider="p",
                         evidence="confirmed_terminal")  # fmt: skip
        if cancelled == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert cancelled == 2
    assert grew(after, "gpuhedge_races_started_total", policy="hedge") == 3
    assert grew(after, "gpuhedge_races_hedged_total", policy="hedge") == 2
    assert grew(after, "gpuhedge_races_won_total", provider="p", role="primary") == 1
    assert grew(after, "gpuhedge_races_won_total", provider="h", role="hedge") == 2
    assert grew(after, "gpuhedge_race_e2e_seconds_count", policy="hedge") == 3
    assert grew(after, "gpuhedge_timer_lag_seconds_count", kind="policy") >= 2  # the hedge timers
    assert grew(after, "gpuhedge_pool_wait_seconds_count", pool="default") == 2
    assert grew(after, "gpuhedge_race_wasted_usd_total") > 0
    # counted in the GPU workers' prefork children, served by their main processes
    assert _handoffs(mc) - handoffs == 2
    gauges = mc.scrape("serve")
    assert sample(gauges, "gpuhedge_redis_up") == 1
    assert sample(gauges, "gpuhedge_pool_gpus", pool="default", state="free") == 2
    assert sample(gauges, "gpuhedge_pool_gpus", pool="default", state="busy") == 0
    assert sample(gauges, "gpuhedge_pool_waiters", pool="default") == 0
    assert sample(gauges, "gpuhedge_timers_overdue", namespace="races") == 0


def test_prometheus_sees_the_hedge_rate_and_the_lease_gauges(metrics_cluster, tmp_path):
    mc = metrics_cluster
    prom = start_prometheus(
        {"gpuhedge-workers": [mc.ports["coord"], mc.ports["gpu0"], mc.ports["gpu1"]],
         "gpuhedge-redis": [mc.ports["serve"]]},
        tmp_path / "prometheus",
    )  # fmt: skip
    try:
        assert prom.wait_value('sum(up{job=~"gpuhedge-.*"})', 4) == 4, prom.log()
        # Three GPU jobs of 4 s on two GPUs: two run, one waits.
        jobs = [mc.pooled(4.0) for _ in range(3)]
        busy = 'gpuhedge_pool_gpus{pool="default",state="busy"}'
        assert prom.wait_value(busy, 2, timeout=10) == 2
        assert prom.wait_value('gpuhedge_pool_waiters{pool="default"}', 1, timeout=5) == 1
        assert prom.value('gpuhedge_pool_gpus{pool="default",state="free"}') == 0
        # Races meanwhile: one in four hedges (on top of what other tests of the module ran).
        coord = mc.scrape("coord")
        started = sum(v for (n, _), v in coord.items() if n == "gpuhedge_races_started_total")
        hedged = sum(v for (n, _), v in coord.items() if n == "gpuhedge_races_hedged_total")
        races = [mc.race(FAST) for _ in range(3)] + [mc.race(HEDGED, policy=HEDGE_POLICY)]
        assert sorted(r.get(timeout=30)["winner"] for r in races) == ["h", "p", "p", "p"]
        expected = (hedged + 1) / (started + 4)
        rate = "sum(gpuhedge_races_hedged_total) / sum(gpuhedge_races_started_total)"
        assert prom.wait_value(rate, expected) == pytest.approx(expected)
        for job in jobs:
            job.get(timeout=30)
        assert prom.wait_value(busy, 0) == 0
        assert prom.value('gpuhedge_pool_gpus{pool="default",state="free"}') == 2
        assert prom.value('gpuhedge_pool_waiters{pool="default"}') == 0
        waits = 'sum(gpuhedge_pool_wait_seconds_count{pool="default"})'
        handoffs = 'sum(gpuhedge_pool_handoff_seconds_count{pool="default"})'
        ran = _handoffs(mc)  # every pooled job of the module: each waited, then was handed off
        assert prom.wait_value(handoffs, ran) == ran
        assert prom.wait_value(waits, ran) == ran
        # every query of the Grafana dashboard runs on this Prometheus, the main ones with data
        answered = {}
        for title, expr in dashboard_queries():
            answered.setdefault(title, []).extend(prom.query(expr))
        for title in ("Hedge rate", "End-to-end latency", "$ per request", "Timer lag",
                      "GPU utilisation", "Waiters", "Pool wait and handoff"):  # fmt: skip
            assert answered[title], title
    finally:
        prom.stop()


def test_a_worker_with_a_taken_port_refuses_to_start(metrics_cluster):
    mc = metrics_cluster
    env = {**mc.cluster.env, "GPUHEDGE_METRICS_PORT": str(mc.ports["coord"])}
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "gpuhedge_celery", "worker", "-n",
         f"taken.{mc.prefix}@localhost", "--without-gossip", "--without-mingle",
         "--without-heartbeat"],
        env=env, capture_output=True, text=True, timeout=60, cwd=os.getcwd(),
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "GPUHEDGE_METRICS_PORT" in lines[0], out.stderr[-2000:]
