"""Real coordination workers racing the loopback provider fakes, with the webhook receiver or not.

:func:`fleet_cluster` writes the config (``tests.support.race_configs``), starts the receiver
(``gpuhedge-celery webhooks``, its own process) when given a webhook secret, then the workers,
and yields a :class:`~tests.support.fixtures_races.RaceCluster` whose ``receiver_log`` is the
receiver's log (None without one). On exit it stops them all and deletes the prefix's keys; the
fakes are the caller's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.cerebrium_fake import KEY as CB_KEY
from tests.support.fixtures_races import REPO, RaceCluster
from tests.support.receiver import start_receiver, stop_receiver
from tests.support.runpod_fake import KEY as RP_KEY
from tests.support.webhook_server import free_port

FAKE_KEYS = {"RUNPOD_TEST_KEY": RP_KEY, "CEREBRIUM_TEST_KEY": CB_KEY}  # the configs' ${VAR}s


def webhook_env(port: int, secret: str, fallback_s: float) -> dict[str, str]:
    """The workers' webhook settings for a receiver on ``port``."""
    return {
        "GPUHEDGE_WEBHOOK_URL": f"http://127.0.0.1:{port}/hooks",
        "GPUHEDGE_WEBHOOK_SECRET": secret,
        "GPUHEDGE_WEBHOOK_FALLBACK_S": f"{fallback_s:g}",
    }


@contextmanager
def fleet_cluster(
    redis_url: str,
    tmp: Path,
    config: str,
    *,
    workers: int = 2,
    broker_url: str | None = None,
    env: dict[str, str] | None = None,
    webhook_secret: str | None = None,
    fallback_s: float = 20,
    receiver_timeout_s: float = 30.0,
) -> Iterator[RaceCluster]:
    """``workers`` coordination workers on a fresh prefix with ``config`` (YAML text) and
    ``env``; webhooks on with ``webhook_secret`` (polled after ``fallback_s``), else off."""
    from gpuhedge_celery.store.connection import redis_from_url
    from gpuhedge_celery.store.listener import enable_notifications
    from tests.support.fixtures_celery import CeleryCluster

    enable_notifications(redis_from_url(redis_url))
    config_path = tmp / "fleet.yaml"
    config_path.write_text(config)
    cc = CeleryCluster(redis_url, f"t{uuid.uuid4().hex[:10]}", tmp, broker_url)
    receiver = None
    try:
        cc.env.update({"GPUHEDGE_CONFIG": str(config_path), "PYTHONPATH": str(REPO)})
        cc.env.update({**FAKE_KEYS, **(env or {})})
        if webhook_secret is None:
            for name in ("GPUHEDGE_WEBHOOK_URL", "GPUHEDGE_WEBHOOK_SECRET"):
                cc.env.pop(name, None)
        else:
            port = free_port()
            cc.env.update(webhook_env(port, webhook_secret, fallback_s))
            receiver = start_receiver(cc.env, port, tmp, timeout_s=receiver_timeout_s)
        cc.wait_ready(*[cc.start_coordinator(wait=False) for _ in range(workers)])
        rc = RaceCluster(cc, config_path)
        rc.receiver_log = None if receiver is None else tmp / "receiver.log"
        yield rc
    finally:
        stop_receiver(receiver)
        cc.close()
        keys = list(cc.client.scan_iter(f"{cc.prefix}:*", count=1000))
        for i in range(0, len(keys), 1000):
            cc.client.delete(*keys[i : i + 1000])
