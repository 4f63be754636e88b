"""The error tree: one-line messages, and types that survive Celery's JSON round trip."""

from __future__ import annotations

import json

import pytest

from gpuhedge_celery.errors import (
    AcquireTimeout,
    ConfigError,
    EmptyPool,
    GpuHedgeError,
    LeaseLost,
    ProviderProtocolError,
    RaceFailed,
    StaleToken,
    SubmitError,
    UnknownPool,
)

CASES = [
    UnknownPool("gpu-a"),
    EmptyPool("gpu-a"),
    LeaseLost("h:0", 7),
    LeaseLost("h:0", 7, "renewal failed"),
    StaleToken("h:0", 3, 5),
    SubmitError("runpod", "HTTP 500 from /run"),
    ProviderProtocolError("runpod", "status reply has no field 'status'"),
    RaceFailed("no valid result", {"race_id": "r1", "attempts": []}),
    ConfigError("expected a number", file="c.yaml", key="providers.a.rate"),
    AcquireTimeout("no GPU of pool 'p' within 5 s"),
]


@pytest.mark.parametrize("exc", CASES, ids=lambda e: type(e).__name__)
def test_rebuilt_from_json_args_like_celery_does(exc):
    # Celery's JSON backend stores exc.args and rebuilds the exception as cls(*args)
    rebuilt = type(exc)(*json.loads(json.dumps(exc.args)))
    assert type(rebuilt) is type(exc)
    assert str(rebuilt) == str(exc)
    assert len(str(exc).splitlines()) == 1
    assert isinstance(rebuilt, GpuHedgeError)
    for field in ("pool", "gpu_id", "token", "current", "provider", "receipt"):
        if hasattr(exc, field):
            assert getattr(rebuilt, field) == getattr(exc, field)


def test_messages_name_what_was_wrong():
    assert str(UnknownPool("gpu-a")) == "unknown pool 'gpu-a': no GPU is registered in it"
    assert str(StaleToken("h:0", 3, 5)) == "GPU 'h:0' refused fencing token 3: token 5 is newer"
    assert str(SubmitError("runpod", "HTTP 500")) == "provider 'runpod': HTTP 500"
    assert str(ConfigError("expected a number", file="c.yaml", key="a.b")) == (
        "c.yaml: a.b: expected a number"
    )
