"""What hedged_infer's arguments resolve to, and the race settings: pure tables, no server."""

from __future__ import annotations

import pytest

from gpuhedge_celery.config import parse_config_text
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.race.settings import RaceSettings
from gpuhedge_celery.race.spec import build_spec, check_request, resolve_policy, spec_from_state
from tests.support.fixtures_races import RACE_CONFIG

CFG = parse_config_text(RACE_CONFIG, source="races.yaml")


@pytest.mark.parametrize(
    ("policy", "providers", "name"),
    [
        (None, None, "hedge:p->h@0.3s"),  # the config's policy, 30 s scaled by 0.01
        ("fixed", None, "hedge:p->h@0.3s"),  # the configured kind keeps its parameters
        ("single", None, "single:p"),
        ("single", ["f"], "single:f"),
        ("state_aware", None, "cutover:p->h@q0.025s+s0.085s"),  # defaults, scaled
        ("cascade", ["h", "p", "f"], "cascade:h->p->f@q0.025s+s0.085s+e0.25s"),
        ("hedge:p->h@1s", None, "hedge:p->h@1s"),  # a full spec is taken as written
        ("cancel_at:p->h@30ms", None, "cancel_at:p->h@0.03s"),  # a plugin's kind
    ],
)
def test_policy_resolution(policy, providers, name):
    assert resolve_policy(CFG, policy, providers).name == name


@pytest.mark.parametrize(
    ("policy", "providers", "fragment"),
    [
        ("nope", None, "policy: expected one of"),
        (42, None, "policy: expected a policy name"),
        ("hedge:p->x@1s", None, "policy: no provider 'x' (known: p, h, f, c)"),
        ("hedge:p->h", ["p", "h"], "providers: name the providers inside the policy spec"),
        ("fixed", ["p"], "providers: policy 'hedge' races 2 provider(s), got 1"),
        ("fixed", ["p", "p"], "providers: a provider appears twice"),
        ("fixed", "p,h", "providers: expected a list of 1-3 provider names"),
        ("fixed", ["p", 3], "providers: expected provider names, got 3"),
    ],
)
def test_policy_errors_are_one_line(policy, providers, fragment):
    with pytest.raises(ConfigError) as info:
        resolve_policy(CFG, policy, providers)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_spec_carries_real_time_caps_and_rates_and_survives_the_state():
    spec = build_spec(CFG, validator={"name": "wav", "sample_rate": 16000})
    assert spec.caps_s == {"p": pytest.approx(1.8), "h": pytest.approx(1.8)}
    # a real second of a 0.01-scaled sim stands for 100 provider seconds
    assert spec.rates["p"] == {"rate_per_s": pytest.approx(0.03), "idle_s": pytest.approx(0.6)}
    assert spec.validator_options == {"sample_rate": 16000}
    state = {"spec": spec.to_dict(), "race": {"policy": spec.policy.to_dict()}}
    assert spec_from_state(state) == spec


@pytest.mark.parametrize(
    ("validator", "fragment"),
    [
        ("nah", "validator: unknown validator 'nah'"),
        ({"name": "wav", "colour": 1}, "validator: bad options for validator 'wav'"),
        ({"colour": 1}, "validator: expected a validator name"),
    ],
)
def test_validator_errors(validator, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_spec(CFG, validator=validator)


@pytest.mark.parametrize("request_", [[1], "text", None, {"x": object()}])
def test_requests_must_be_json_objects(request_):
    with pytest.raises(ConfigError, match="^request: "):
        check_request(request_)


def test_settings_defaults_and_values():
    assert RaceSettings.from_env({}) == RaceSettings()
    s = RaceSettings.from_env(
        {
            "GPUHEDGE_RECEIPT_TTL_S": "60",
            "GPUHEDGE_PAYLOAD_INLINE_MAX": "0",
            "GPUHEDGE_RACE_EVENTS": "off",
            "GPUHEDGE_PLUGINS": "json, tests.support.fixtures_races",
            "GPUHEDGE_SUBMIT_PRIMARY_INLINE": "false",
        }
    )
    assert (s.receipt_ttl_s, s.payload_inline_max, s.events) == (60.0, 0, False)
    assert s.plugins == ("json", "tests.support.fixtures_races") and not s.submit_primary_inline
    s.import_plugins()
    assert s.as_celery_conf()["gpuhedge_race_receipt_ttl_s"] == 60.0


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"GPUHEDGE_RECEIPT_TTL_S": "soon"}, "GPUHEDGE_RECEIPT_TTL_S: expected a number"),
        ({"GPUHEDGE_WATCH_INTERVAL_S": "0"}, "GPUHEDGE_WATCH_INTERVAL_S: expected a number > 0"),
        ({"GPUHEDGE_RACE_EVENTS": "maybe"}, "GPUHEDGE_RACE_EVENTS: expected 1/0"),
        ({"GPUHEDGE_PLUGINS": "not a module"}, "GPUHEDGE_PLUGINS: expected a module path"),
        ({"GPUHEDGE_TIMER_NAMESPACE": "a b"}, "GPUHEDGE_TIMER_NAMESPACE: expected letters"),
    ],
)
def test_settings_errors_name_the_variable(env, fragment):
    with pytest.raises(ConfigError, match=fragment):
        RaceSettings.from_env(env)


def test_a_missing_plugin_is_a_config_error():
    with pytest.raises(ConfigError, match="GPUHEDGE_PLUGINS: cannot import plugin 'no_such_mod'"):
        RaceSettings.from_env({"GPUHEDGE_PLUGINS": "no_such_mod"}).import_plugins()


def test_hedged_infer_imports_first_in_a_fresh_process():
    """``from gpuhedge_celery import hedged_infer`` loads tasks.races before tasks.app, whose
    task modules (the janitor's) build on the race runtime: no import cycle may break that."""
    import subprocess
    import sys

    code = (
        "from gpuhedge_celery import hedged_infer\n"
        "from gpuhedge_celery.tasks import app, race_runtime\n"
        "assert race_runtime.QUEUE_ATTEMPTS == app.QUEUE_ATTEMPTS\n"
        "assert set(app.app.tasks) >= {'gpuhedge.hedged_infer', 'gpuhedge.race_submit'}\n"
        "print(hedged_infer.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gpuhedge.hedged_infer"
