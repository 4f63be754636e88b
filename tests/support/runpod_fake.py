"""The loopback RunPod fake for tests: a real HTTP server in its own process.

The fake itself is ``benchmarks/fakes/runpod_fake.py`` because ``gpuhedge-celery bench races
--provider runpod-fake`` runs it too (from a source checkout); this module is what tests use:
the process handle, and a helper that builds a ``runpod`` provider pointed at it.
Fixtures: ``tests/support/fixtures_runpod.py``.

    def test_x(runpod):                       # the module's fake, reset for this test
        runpod.configure(queue_s=0.0, run_s=0.2)
        provider = runpod_provider(runpod)
"""

from __future__ import annotations

import copy
from typing import Any

from benchmarks.fakes.runpod_fake import FakeRunpod, default_config
from gpuhedge_celery.config import parse_config

__all__ = ["KEY", "FakeRunpod", "default_config", "runpod_block", "runpod_provider"]

KEY = "rp-test-key-0123456789-very-secret"  # the fake's API key; must never leak anywhere


def runpod_block(fake: FakeRunpod, endpoint: str = "ep1", **overrides: Any) -> dict[str, Any]:
    """A ``runpod:`` block pointed at ``fake`` (the key from ``${RUNPOD_TEST_KEY}``)."""
    block: dict[str, Any] = {
        "endpoint_id": endpoint,
        "api_key": "${RUNPOD_TEST_KEY}",
        "base_url": fake.base_url,
        "graphql_url": f"{fake.url}/graphql",
        "payload": "output.audio_base64",
        "timeouts": {"connect_s": 2, "read_s": 2},
        "poll": {"min_s": 0.02, "max_s": 0.2, "fraction": 0.25},
        "cancel_confirm_s": 3,
        "cancel_poll_s": 0.02,
        "retries": {"attempts": 3, "backoff_s": 0.02, "max_backoff_s": 0.2, "max_block_s": 3},
    }
    for key, value in overrides.items():
        block[key] = copy.deepcopy(value)
    return block


def runpod_provider(fake: FakeRunpod, endpoint: str = "ep1", *, limiter: Any = None,
                    key: str = KEY, **overrides: Any) -> Any:  # fmt: skip
    """A ``RunpodProvider`` on ``fake`` (``limiter``: default, an in-process bucket)."""
    from gpuhedge_celery.providers.ratelimit import LocalLimiter

    block = runpod_block(fake, endpoint, **overrides)
    cfg = parse_config(
        {"providers": {"rp": {"adapter": "runpod", "billed_rate_per_s": 0.001,
                              "runpod": block}},
         "budget": {"ceiling_usd": 1000}},
        source="t.yaml",
    )  # fmt: skip
    return cfg.build("rp", env={"RUNPOD_TEST_KEY": key},
                     limiter=limiter if limiter is not None else LocalLimiter())  # fmt: skip
