"""A race's own ``validator=`` under a config whose validator is ``hmac``: it adds a check after
the signature's, never replaces it, so whoever sends a message cannot switch signature checks
off. Pure: the spec a worker builds and the verdict it gives (the same through real workers and
a forged webhook delivery: ``tests/test_signed_races.py``)."""

from __future__ import annotations

import base64

import pytest

from gpuhedge_celery.config import parse_config_text
from gpuhedge_celery.core.validators import tone_wav, validate
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.signing import sign_result

KEY = "result-signing-key-0123456789"
REF = "${GPUHEDGE_TEST_RESULT_KEY}"
SIM = "providers:\n  p: {adapter: sim}\n  h: {adapter: sim, role: hedge}\n"
SIGNED_WAV = f'validator: {{name: hmac, key: "{REF}", then: wav, at: audio_base64}}\n'


@pytest.fixture(autouse=True)
def signing_key(monkeypatch):
    monkeypatch.setenv("GPUHEDGE_TEST_RESULT_KEY", KEY)


def verdict(spec, payload):
    return validate(spec.validator, payload, **spec.validator_options)


def audio(rate=16_000):
    return base64.b64encode(tone_wav(1.0, sample_rate=rate)).decode("ascii")


GENUINE = sign_result({"audio_base64": audio()}, KEY)
FORGED = sign_result({"audio_base64": audio()}, "attacker-key-0123456789")


@pytest.mark.parametrize(
    "call",
    ["nonempty", "wav", {"name": "json"}, {"name": "hmac", "key": "${HOME}"}],
    ids=["nonempty", "wav", "json", "hmac-other-key"],
)
def test_a_calls_validator_cannot_let_a_forged_result_through(call):
    cfg = parse_config_text(SIM + SIGNED_WAV)
    spec = build_spec(cfg, validator=call)
    assert spec.validator == "hmac" and spec.validator_options["key"] == REF
    assert not verdict(spec, FORGED).ok
    assert "signature does not match" in verdict(spec, FORGED).reasons
    assert not verdict(spec, {"audio_base64": audio()}).ok  # unsigned


def test_a_calls_validator_adds_its_check_after_the_configs_own():
    cfg = parse_config_text(SIM + SIGNED_WAV)
    assert verdict(build_spec(cfg), GENUINE).ok
    assert verdict(build_spec(cfg, validator="nonempty"), GENUINE).ok
    # the call's check is given what the config's ``then`` is given (the field at ``at``)
    strict = build_spec(cfg, validator={"name": "wav", "sample_rate": 24_000})
    assert strict.validator_options["then"] == ["wav", {"name": "wav", "sample_rate": 24_000}]
    refused = verdict(strict, GENUINE)
    assert not refused.ok and refused.reasons == ("sample rate 16000 Hz, expected 24000 Hz",)
    assert verdict(strict, sign_result({"audio_base64": audio(24_000)}, KEY)).ok
    # naming the config's own validator changes nothing
    same = {"name": "hmac", "key": REF, "then": "wav", "at": "audio_base64"}
    assert build_spec(cfg, validator=same) == build_spec(cfg)


def test_without_hmac_in_the_config_a_calls_validator_replaces_it_as_before():
    cfg = parse_config_text(SIM + "validator: wav\n")
    spec = build_spec(cfg, validator="nonempty")
    assert (spec.validator, dict(spec.validator_options)) == ("nonempty", {})
    assert verdict(spec, FORGED).ok


def test_a_calls_bad_validator_is_still_one_line_under_hmac():
    cfg = parse_config_text(SIM + SIGNED_WAV)
    with pytest.raises(ConfigError, match="unknown validator 'nah'"):
        build_spec(cfg, validator="nah")
    with pytest.raises(ConfigError, match="bad options for validator 'wav'"):
        build_spec(cfg, validator={"name": "wav", "colour": 1})


def test_then_takes_a_list_every_one_of_which_must_pass():
    value = {"audio_base64": audio(), "text": "hi"}
    both = validate("hmac", sign_result(value, KEY), key=REF, then=["nonempty", "json"])
    assert both.ok and both.details["signed"]
    one_fails = ["nonempty", {"name": "json", "required": ["missing"]}]
    failed = validate("hmac", sign_result(value, KEY), key=REF, then=one_fails)
    assert not failed.ok and failed.reasons == ("missing keys: missing",)
    with pytest.raises(ConfigError, match="then: expected a validator or a list of them"):
        parse_config_text(SIM + f'validator: {{name: hmac, key: "{REF}", then: []}}\n')
    with pytest.raises(ConfigError, match="then: unknown validator 'nah'"):
        parse_config_text(SIM + f'validator: {{name: hmac, key: "{REF}", then: [wav, nah]}}\n')
