"""The error tree: one-line messages, and types that survive Celery's JSON round trip."""

from __future__ import annotations

import json

import pytest

from gpuhedge_celery.errors import (
    AcquireTimeout,
    BudgetExceeded,
    ConfigError,
    EmptyPool,
    GpuHedgeError,
    LeaseLost,
    ProviderProtocolError,
    RaceFailed,
    RateLimited,
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
    RaceFailed(
        "race r2: no attempt returned a valid result",
        {
            "race_id": "r2",
            "attempts": [
                {
                    "id": "a1",
                    "provider": "p",
                    "role": "primary",
                    "state": "COMPLETED",
                    "valid": False,
                    "reasons": ["wav: near-silent\n(rms 0.0001)"],
                },
                {
                    "id": "a2",
                    "provider": "h",
                    "role": "hedge",
                    "state": "FAILED",
                    "valid": False,
                    "reasons": ["simulated job failure"],
                },
            ],
        },
    ),  # fmt: skip
    BudgetExceeded("budget: refused by ceiling_usd", {"race_id": "r1"}, "budget"),
    ConfigError("expected a number", file="c.yaml", key="providers.a.rate"),
    AcquireTimeout("no GPU of pool 'p' within 5 s"),
    RateLimited("runpod", "status GET /status/{id}: HTTP 429", 1_800_000_000.5),
]


@pytest.mark.parametrize("exc", CASES, ids=lambda e: type(e).__name__)
def test_rebuilt_from_json_args_like_celery_does(exc):
    # Celery's JSON backend stores exc.args and rebuilds the exception as cls(*args)
    rebuilt = type(exc)(*json.loads(json.dumps(exc.args)))
    assert type(rebuilt) is type(exc)
    assert str(rebuilt) == str(exc)
    assert len(str(exc).splitlines()) == 1
    assert isinstance(rebuilt, GpuHedgeError)
    for field in (
        "pool",
        "gpu_id",
        "token",
        "current",
        "provider",
        "receipt",
        "retry_at",
        "reason",
    ):
        if hasattr(exc, field):
            assert getattr(rebuilt, field) == getattr(exc, field)


def test_messages_name_what_was_wrong():
    assert str(UnknownPool("gpu-a")) == "unknown pool 'gpu-a': no GPU is registered in it"
    assert str(StaleToken("h:0", 3, 5)) == "GPU 'h:0' refused fencing token 3: token 5 is newer"
    assert str(SubmitError("runpod", "HTTP 500")) == "provider 'runpod': HTTP 500"
    assert str(ConfigError("expected a number", file="c.yaml", key="a.b")) == (
        "c.yaml: a.b: expected a number"
    )


def test_race_failed_says_why_each_attempt_did_not_win():
    receipt = {
        "race_id": "r",
        "attempts": [
            {"id": "a1", "provider": "cheap", "role": "primary", "state": "COMPLETED",
             "valid": False, "reasons": ["wav: near-silent"]},
            {"id": "a2", "provider": "steady", "role": "hedge", "state": "FAILED",
             "valid": False, "reasons": ["HTTP 500 from /status"]},
            {"id": "a3", "provider": "reserve", "role": "fallback", "state": "CANCELLED",
             "valid": None, "reasons": []},
        ],
    }  # fmt: skip
    error = RaceFailed("race r: no attempt returned a valid result", receipt)
    assert str(error) == (
        "race r: no attempt returned a valid result [a1 cheap (primary) COMPLETED, invalid: "
        "wav: near-silent | a2 steady (hedge) FAILED: HTTP 500 from /status | "
        "a3 reserve (fallback) CANCELLED]"
    )
    assert error.receipt is receipt
    # what an app without gpuhedge_celery gets: Celery's stand-in built from args[0]
    assert error.args[0] == str(error)
    assert str(RaceFailed(*error.args)) == str(error)


def test_every_error_message_is_one_line_even_when_it_quotes_bad_input():
    """A message quoting a caller's policy name, a YAML scalar or a provider's reply keeps to
    one line: its line breaks are shown escaped."""
    from gpuhedge_celery.errors import ConfigError, GpuHedgeError

    err = ConfigError("bad policy name 'single:->\n@'", file="c.yaml", key="policy.name")
    assert str(err) == "c.yaml: policy.name: bad policy name 'single:->\\n@'"
    assert "\n" not in str(GpuHedgeError("a\r\nb")) and "a\\r\\nb" == str(GpuHedgeError("a\r\nb"))
