"""Fixtures for distributed races: real Celery workers racing sim providers on compressed time.

``race_cluster`` (one per test module) starts two real coordination workers (threads pool,
consuming ``gpuhedge.coord`` and ``gpuhedge.attempts``) with a sim config at ``time_scale``
0.01 (a provider second is 10 ms), so a race with a 100 s slow primary takes about a second.
Requests force each job's fate with ``{"sim": {provider: {queue_s, run_s, outcome, ...}}}``.

Also a test plugin: the ``cancel_at`` policy (imported by the workers through
``GPUHEDGE_PLUGINS``) cancels its primary at a fixed time without any winner and launches the
hedge, which built-in policies only do to a job still queued (and a sim job cancelled while
queued can never finish); it is how a cancelled-but-unconfirmed primary gets to win.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import shared_task

from gpuhedge_celery.core.policy_base import (
    DURATION_RE,
    HEDGE,
    PRIMARY,
    PROVIDER_RE,
    Policy,
    bad_name,
    check_ms,
    duration_ms,
    fmt_s,
    register_policy,
    registered_policies,
)
from tests.support.race_configs import race_config, sim_pair, sim_provider

REPO = Path(__file__).resolve().parents[2]

RACE_CONFIG = race_config(
    {
        **sim_pair(p_fast=(1, 4), h_fast=(0.5, 5), cancel=(0.28, 0.35)),
        "f": sim_provider("fallback", 0.0011, 3, (0.2, 3)),
        # a provider with a short cap: 20 s (200 ms real)
        "c": sim_provider("hedge", 0.0005, 4, (0, 100), timeout_s=20),
    },
    "fixed",
    {"hedge_after_ms": 30000},  # 300 ms real: room for a loaded machine's lag
    time_scale=0.01,
    timeouts={"attempt_cap_s": 180},
)


class CancelAtPolicy(Policy):
    """Test policy: cancel the primary ``cancel_after_ms`` after its submit and launch the hedge."""

    kind = "cancel_at"

    def __init__(self, primary: str, hedge: str, cancel_after_ms: int = 300):
        self.primary = primary
        self.hedge = hedge
        self.cancel_after_ms = check_ms(cancel_after_ms, "cancel_after_ms")

    def providers(self) -> tuple[str, ...]:
        return (self.primary, self.hedge)

    @property
    def name(self) -> str:
        return f"cancel_at:{self.primary}->{self.hedge}@{fmt_s(self.cancel_after_ms)}s"

    def params(self) -> dict[str, Any]:
        return {
            "primary": self.primary,
            "hedge": self.hedge,
            "cancel_after_ms": self.cancel_after_ms,
        }

    @classmethod
    def parse(cls, body: str) -> Policy:
        m = re.fullmatch(rf"({PROVIDER_RE})->({PROVIDER_RE})@{DURATION_RE}", body)
        if not m:
            raise bad_name("cancel_at", body, "PRIMARY->HEDGE@Ds")
        return cls(m.group(1), m.group(2), duration_ms(m.group(3), m.group(4)))

    def on_submitted(self, ctl, attempt) -> None:
        if attempt.role == PRIMARY:
            ctl.set_timer("cancel", self.cancel_after_ms / 1000)

    def on_timer(self, ctl, key: str) -> None:
        primary = ctl.attempt_for(PRIMARY)
        if key == "cancel" and primary is not None and primary.live:
            ctl.cancel(primary.id, "test: cancelled at a fixed time")
            ctl.launch(self.hedge, HEDGE)


if "cancel_at" not in registered_policies():
    register_policy(CancelAtPolicy)


class RaceCluster:
    """Real workers plus helpers to run races and read what they left in Redis."""

    def __init__(self, cluster: Any, config_path: Path):
        from gpuhedge_celery.config import load_config
        from gpuhedge_celery.providers.simledger import RedisLedger
        from gpuhedge_celery.settings import ProcessSettings
        from gpuhedge_celery.store.connection import redis_from_url
        from gpuhedge_celery.store.races import RaceStore

        self.cluster = cluster
        self.app = cluster.app
        self.prefix = cluster.prefix
        self.redis_url = cluster.redis_url
        self.config_path = config_path
        self.client = redis_from_url(cluster.redis_url, decode_responses=True)
        # where the workers put races (GPUHEDGE_RACE_SHARDS, its default from the Redis URL)
        shards = ProcessSettings.from_env().race_shards(self.prefix, cluster.redis_url)
        self.store = RaceStore(self.client, shards)
        self.ledger = RedisLedger(self.client, self.prefix)
        self.config = load_config(config_path)

    def send(self, request: dict[str, Any], **kwargs: Any) -> Any:
        """``send_task("gpuhedge.hedged_infer", ...)``: the AsyncResult (its id is the race id)."""
        return self.app.send_task(
            "gpuhedge.hedged_infer", (request,), kwargs, queue="gpuhedge.coord"
        )

    def receipt(self, race_id: str, timeout: float = 20.0) -> dict[str, Any]:
        """Wait for the race's final receipt (written once every attempt is settled)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.store.receipt(race_id)
            if found is not None:
                return found
            time.sleep(0.02)
        raise AssertionError(f"no receipt for race {race_id} after {timeout} s")

    def running_sim_jobs(self, receipt: dict[str, Any]) -> list[str]:
        """Job ids of the receipt's sim jobs that are still not terminal right now."""
        from gpuhedge_celery.providers.redis_ledger import sim_job_running

        running = []
        for attempt in receipt["attempts"]:
            if attempt.get("handle"):
                provider = self.config.build(attempt["provider"], ledger=self.ledger)
                if sim_job_running(provider, attempt["handle"]):
                    running.append(attempt["job_id"])
        return running

    def logs(self) -> str:
        return self.cluster.logs()


def start_race_cluster(
    redis_url: str,
    tmp: Path,
    workers: int = 2,
    config: str = RACE_CONFIG,
    *,
    broker_url: str | None = None,
    **env: str,
) -> RaceCluster:
    """Two (by default) real coordination workers on a fresh prefix with the test config
    (``config``: another YAML text, e.g. with a budget; ``broker_url``: the broker when it is
    not the test Redis, e.g. a RabbitMQ vhost)."""
    from tests.support.fixtures_celery import CeleryCluster

    config_path = tmp / "races.yaml"
    config_path.write_text(config)
    prefix = f"t{uuid.uuid4().hex[:10]}"
    cluster = CeleryCluster(redis_url, prefix, tmp, broker_url)
    extra = {
        "GPUHEDGE_CONFIG": str(config_path),
        "GPUHEDGE_PLUGINS": "tests.support.fixtures_races",
        "PYTHONPATH": str(REPO),
        **env,
    }
    cluster.env.update(extra)
    started = [cluster.start_coordinator(wait=False) for _ in range(workers)]
    cluster.wait_ready(*started)
    rc = RaceCluster(cluster, config_path)
    for _ in range(workers):  # warm each worker (lazy imports, first config load) before timing
        rc.send({"sim": {"p": {"queue_s": 0, "run_s": 0}}}).get(timeout=30)
    return rc


def stop_race_cluster(rc: RaceCluster) -> None:
    rc.cluster.close()
    keys = list(rc.client.scan_iter(f"{rc.prefix}:*", count=1000))
    if keys:
        rc.client.delete(*keys)
    rc.client.close()


@pytest.fixture(scope="module")
def race_cluster(redis_url, tmp_path_factory, broker, request):
    """Two real coordination workers shared by one test module (logs printed on teardown)."""
    from gpuhedge_celery.store.connection import redis_from_url
    from gpuhedge_celery.store.listener import enable_notifications
    from tests.support.fixtures_celery import broker_url_for

    enable_notifications(redis_from_url(redis_url))
    rc = start_race_cluster(
        redis_url, tmp_path_factory.mktemp("races"), broker_url=broker_url_for(broker, request)
    )
    yield rc
    stop_race_cluster(rc)


ERRBACK_LIST = "test:errbacks"  # under the cluster's prefix: "<prefix>:test:errbacks"


@shared_task(name="tests.record_errback")
def record_errback(request: Any, exc: Any, traceback: Any) -> None:
    """A ``link_error`` for the workers (imported as a plugin): records who failed and why."""
    import os

    from gpuhedge_celery.store.connection import redis_from_url

    client = redis_from_url(os.environ["GPUHEDGE_REDIS_URL"])  # a Sentinel URL too
    key = f"{os.environ['GPUHEDGE_PREFIX']}:{ERRBACK_LIST}"
    client.rpush(key, f"{request.id}|{type(exc).__name__}|{exc}")
