"""Policy names, parameters, validation and the registry (pure tables, no engine)."""

from __future__ import annotations

import json

import pytest

from gpuhedge_celery.core.policies import (
    CascadePolicy,
    FixedHedgePolicy,
    Policy,
    SinglePolicy,
    StateAwarePolicy,
    parse_policy,
    policy_from_dict,
    register_policy,
    registered_policies,
)
from gpuhedge_celery.errors import ConfigError


@pytest.mark.parametrize(
    "text,cls,params,canonical",
    [
        ("single:runpod", SinglePolicy, {"primary": "runpod"}, "single:runpod"),
        (
            "hedge:runpod->cerebrium@10s",
            FixedHedgePolicy,
            {"primary": "runpod", "hedge": "cerebrium", "hedge_after_ms": 10_000},
            "hedge:runpod->cerebrium@10s",
        ),
        (
            "hedge:runpod->cerebrium@0s",
            FixedHedgePolicy,
            {"primary": "runpod", "hedge": "cerebrium", "hedge_after_ms": 0},
            "hedge:runpod->cerebrium@0s",
        ),
        (
            "hedge:a->b",
            FixedHedgePolicy,
            {"primary": "a", "hedge": "b", "hedge_after_ms": 10_000},
            "hedge:a->b@10s",
        ),
        (
            "fixed:a->b@2500ms",
            FixedHedgePolicy,
            {"primary": "a", "hedge": "b", "hedge_after_ms": 2_500},
            "hedge:a->b@2.5s",
        ),
        (
            "cutover:runpod->cerebrium@q2.5s+s8.5s",
            StateAwarePolicy,
            {
                "primary": "runpod",
                "hedge": "cerebrium",
                "queue_cutover_ms": 2_500,
                "safety_hedge_ms": 8_500,
            },
            "cutover:runpod->cerebrium@q2.5s+s8.5s",
        ),
        (
            "state_aware:a->b",
            StateAwarePolicy,
            {"primary": "a", "hedge": "b", "queue_cutover_ms": 2_500, "safety_hedge_ms": 8_500},
            "cutover:a->b@q2.5s+s8.5s",
        ),
        (
            "cascade:runpod->cerebrium->modal@q3s+s9s+e30s",
            CascadePolicy,
            {
                "primary": "runpod",
                "hedge": "cerebrium",
                "fallback": "modal",
                "queue_cutover_ms": 3_000,
                "safety_hedge_ms": 9_000,
                "escalate_after_ms": 30_000,
            },
            "cascade:runpod->cerebrium->modal@q3s+s9s+e30s",
        ),
        (
            "cascade:a->b->c",
            CascadePolicy,
            {
                "primary": "a",
                "hedge": "b",
                "fallback": "c",
                "queue_cutover_ms": 2_500,
                "safety_hedge_ms": 8_500,
                "escalate_after_ms": 25_000,
            },
            "cascade:a->b->c@q2.5s+s8.5s+e25s",
        ),
        ("  single:gpu-1.eu  ", SinglePolicy, {"primary": "gpu-1.eu"}, "single:gpu-1.eu"),
    ],
)
def test_parse(text, cls, params, canonical):
    policy = parse_policy(text)
    assert type(policy) is cls
    assert policy.params() == params
    assert policy.name == canonical
    assert parse_policy(policy.name) == policy  # names round-trip
    assert policy_from_dict(json.loads(json.dumps(policy.to_dict()))) == policy


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("", "expected KIND:ARGS"),
        ("runpod", "expected KIND:ARGS"),
        ("nope:a", "unknown policy kind 'nope'"),
        ("single:", "expected single:PROVIDER"),
        ("single:a->b", "expected single:PROVIDER"),
        ("hedge:a", "expected hedge:PRIMARY->HEDGE@Ds"),
        ("hedge:a->b@10", "expected hedge:PRIMARY->HEDGE@Ds"),
        ("hedge:a->b@-1s", "expected hedge:PRIMARY->HEDGE@Ds"),
        ("cutover:a->b@q2s", "expected cutover:PRIMARY->HEDGE@qQs+sSs"),
        ("cutover:a->b@q9s+s2s", "must not be before"),
        ("cascade:a->b@q1s+s2s+e3s", "expected cascade:PRIMARY->HEDGE->FALLBACK"),
    ],
)
def test_bad_names_are_one_line_config_errors(text, fragment):
    with pytest.raises(ConfigError) as info:
        parse_policy(text)
    message = str(info.value)
    assert fragment in message and "\n" not in message


@pytest.mark.parametrize(
    "build",
    [
        lambda: FixedHedgePolicy("a", "b", -5),
        lambda: FixedHedgePolicy("a", "b", "10"),
        lambda: StateAwarePolicy("a", "b", queue_cutover_ms=None),
        lambda: CascadePolicy("a", "b", "c", escalate_after_ms=True),
    ],
)
def test_bad_parameters_are_config_errors(build):
    with pytest.raises(ConfigError):
        build()


def test_defaults_are_the_documented_ones():
    assert FixedHedgePolicy("a", "b").hedge_after_ms == 10_000
    s = StateAwarePolicy("a", "b")
    assert (s.queue_cutover_ms, s.safety_hedge_ms) == (2_500, 8_500)
    assert CascadePolicy("a", "b", "c").escalate_after_ms == 25_000


def test_registry_rejects_clashes_and_bad_kinds():
    assert {"single", "hedge", "fixed", "cutover", "state_aware", "cascade"} <= set(
        registered_policies()
    )

    class Clash(Policy):
        kind = "hedge"

    with pytest.raises(ValueError, match="already registered"):
        register_policy(Clash)

    class Bad(Policy):
        kind = "Not A Kind"

    with pytest.raises(ValueError, match="lowercase"):
        register_policy(Bad)
    with pytest.raises(ConfigError):
        policy_from_dict({"kind": "unregistered", "params": {}})
