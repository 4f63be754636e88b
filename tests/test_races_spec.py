"""What hedged_infer's arguments resolve to, and the race settings: pure tables, no server."""

from __future__ import annotations

import pytest

from gpuhedge_celery.config import load_config, packaged_path, parse_config_text
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.race.settings import RaceSettings
from gpuhedge_celery.race.spec import (
    build_spec,
    check_request,
    longest_race_s,
    resolve_policy,
    spec_from_state,
)
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
            "GPUHEDGE_ACK_LINGER_MS": "0",
        }
    )
    assert (s.receipt_ttl_s, s.payload_inline_max, s.events) == (60.0, 0, False)
    assert s.plugins == ("json", "tests.support.fixtures_races")
    assert s.ack_linger_ms == 0.0 and RaceSettings().ack_linger_ms == 250.0
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
        ({"GPUHEDGE_ACK_LINGER_MS": "-5"}, "GPUHEDGE_ACK_LINGER_MS: expected a number"),
        ({"GPUHEDGE_RACE_SHARDS": "65"}, "GPUHEDGE_RACE_SHARDS: expected a whole number from 1 to"),
        ({"GPUHEDGE_RACE_SHARDS": "0"}, "GPUHEDGE_RACE_SHARDS: expected a whole number from 1 to"),
        ({"GPUHEDGE_RACE_SHARDS": "2.5"}, "GPUHEDGE_RACE_SHARDS: expected a whole number"),
    ],
)
def test_settings_errors_name_the_variable(env, fragment):
    with pytest.raises(ConfigError, match=fragment):
        RaceSettings.from_env(env)


def test_a_missing_plugin_is_a_config_error():
    with pytest.raises(ConfigError, match="GPUHEDGE_PLUGINS: cannot import plugin 'no_such_mod'"):
        RaceSettings.from_env({"GPUHEDGE_PLUGINS": "no_such_mod"}).import_plugins()


def test_hedged_infer_imports_first_in_a_fresh_process():
    """``from gpuhedge_celery import hedged_infer`` loads tasks.races first, and tasks.app from
    it: no import cycle may break that (tests/test_imports_fresh.py: every public name)."""
    import subprocess
    import sys

    code = (
        "from gpuhedge_celery import hedged_infer\n"
        "from gpuhedge_celery.tasks import app, race_runtime\n"
        "assert race_runtime.TASK_RACE_SUBMIT in app.app.tasks\n"
        "assert set(app.app.tasks) >= {'gpuhedge.hedged_infer', 'gpuhedge.race_submit'}\n"
        "print(hedged_infer.name)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gpuhedge.hedged_infer"


def test_longest_race_is_the_latest_timer_plus_each_providers_slowest_attempt():
    slack = 5.0
    # RACE_CONFIG (time scale 0.01): p takes 1 + 4 s, h 0.5 + 5 s, hedge timer 30 s
    assert longest_race_s(CFG) == pytest.approx(0.01 * (30 + (1 + 4) + (0.5 + 5)) + slack)
    assert longest_race_s(CFG, "single") == pytest.approx(0.01 * (1 + 4) + slack)
    # c's job would take 100 s, but its cap (timeout_s: 20) ends the attempt first
    assert longest_race_s(CFG, "hedge:p->c@1s", slack_s=0) == pytest.approx(1 + 0.05 + 0.2)
    # a lognormal has no slowest draw: the attempt cap bounds it
    lognormal = parse_config_text(
        "providers:\n  p:\n    adapter: sim\n    sim:\n      fast: {queue_s: 1, run_s:"
        " {lognormal: {median: 5, sigma: 1}}}\npolicy: {name: single}\n"
        "timeouts: {attempt_cap_s: 50}\n"
    )
    assert longest_race_s(lognormal, slack_s=0) == pytest.approx(50)


def test_the_packaged_default_injects_no_faults_and_the_demo_does():
    default = load_config(packaged_path("default.yaml"))
    demo = load_config(packaged_path("demo.yaml"))
    sims = [p.spec for p in default.providers.values() if p.adapter == "sim"]
    assert sims and all(s.invalid_probability == 0 == s.fail_probability for s in sims)
    demo_sims = [p.spec for p in demo.providers.values() if p.adapter == "sim"]
    assert any(s.invalid_probability > 0 for s in demo_sims)
    assert any(s.fail_probability > 0 for s in demo_sims)
    # the default's slowest race: hedge timer + the primary's and the hedge's slowest jobs
    cheap, steady = default.provider("sim-cheap").spec, default.provider("sim-steady").spec
    slowest = 10 + cheap.slow.queue_s.b + cheap.slow.run_s.b + steady.longest_job_s()
    assert longest_race_s(default, slack_s=0) == pytest.approx(slowest)


@pytest.mark.parametrize(
    ("env", "shards"),
    [
        ({}, 1),
        ({"GPUHEDGE_REDIS_URL": "redis://h:6379/0"}, 1),
        ({"GPUHEDGE_REDIS_URL": "redis+cluster://h1:7000,h2:7001/0"}, 3),
        ({"GPUHEDGE_REDIS_URL": "rediss+cluster://h1:7000/0"}, 3),
        ({"GPUHEDGE_REDIS_URL": "redis+cluster://h1:7000/0", "GPUHEDGE_RACE_SHARDS": "6"}, 6),
        ({"GPUHEDGE_RACE_SHARDS": "64"}, 64),
    ],
)
def test_race_shards_default_to_one_and_to_three_on_a_cluster(env, shards):
    assert RaceSettings.from_env(env).race_shards == shards


def test_the_shard_bound_is_the_key_layouts():
    from gpuhedge_celery import envvars
    from gpuhedge_celery.store.race_keys import MAX_SHARDS

    assert envvars.MAX_RACE_SHARDS == MAX_SHARDS
