"""Signed results: ``signing.sign_result`` in the user's function, the ``hmac`` validator on the
worker. Pure: no Redis, no Celery (the race through a Cerebrium fake is in
``tests/test_signed_races.py``)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import subprocess
import sys

import pytest

from gpuhedge_celery.config import parse_config_text
from gpuhedge_celery.core.validators import tone_wav, validate
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.signing import canonical, sign_result, signature

KEY = "result-signing-key-0123456789"
REF = "${GPUHEDGE_TEST_RESULT_KEY}"
SIM = "providers:\n  p: {adapter: sim}\n"


@pytest.fixture(autouse=True)
def signing_key(monkeypatch):
    monkeypatch.setenv("GPUHEDGE_TEST_RESULT_KEY", KEY)


def audio(amplitude=0.3):
    return base64.b64encode(tone_wav(1.0, amplitude=amplitude)).decode("ascii")


def check(payload, **options):
    return validate("hmac", payload, key=REF, **options)


def test_the_signature_is_hmac_sha256_over_the_canonical_json_of_the_payload():
    payload = {"z": [1, {"b": "é", "a": None}], "a": "x y", "n": 7}
    # sorted keys at every level, no whitespace, UTF-8 rather than \u escapes
    assert canonical(payload) == '{"a":"x y","n":7,"z":[1,{"a":null,"b":"é"}]}'.encode()
    mac = hmac.new(KEY.encode(), b"gpuhedge-result-v1\n" + canonical(payload), hashlib.sha256)
    signed = sign_result(payload, KEY)
    assert signed["signature"] == "v1=" + mac.hexdigest()
    assert {k: v for k, v in signed.items() if k != "signature"} == payload
    # the signature field is left out of what is signed, so signing twice gives the same
    assert sign_result(signed, KEY) == signed and signature(signed, KEY) == signed["signature"]


def test_a_good_signature_passes_and_any_change_fails():
    signed = sign_result({"audio_base64": audio(), "text": "hello"}, KEY)
    assert check(signed).ok
    for changed in (
        {**signed, "text": "hellO"},  # the payload altered
        {**signed, "extra": 1},  # a field added
        {**signed, "signature": signed["signature"].upper()},
        {**signed, "signature": "v1=" + "0" * 64},
        {**signed, "signature": 12},
        sign_result({"audio_base64": audio(), "text": "hello"}, "another-key-0123456789"),
    ):
        assert check(changed).reasons == ("signature does not match",), changed.get("text")
    unsigned = {"audio_base64": audio(), "text": "hello"}
    assert check(unsigned).reasons == ("signature missing (no 'signature' field)",)
    assert check(audio()).reasons[0].startswith("signature missing: the payload is a str")
    assert not check(None).ok


def test_no_reason_or_detail_ever_shows_the_key():
    signed = sign_result({"text": "hi"}, KEY)
    verdicts = [
        check(signed),
        check({**signed, "text": "x"}),
        check({"text": "hi"}),
        check(signed, then="wav", at="text"),
        check({"text": float("nan"), "signature": "v1=00"}),
        validate("hmac", signed, key="${GPUHEDGE_TEST_UNSET_KEY}"),
        validate("hmac", signed, key=KEY),  # a literal key: refused without echoing it
    ]
    for verdict in verdicts:
        assert KEY not in repr(verdict.to_dict())
    assert verdicts[-1].reasons[0].startswith("hmac: key: expected a ${VAR} reference")
    assert verdicts[-2].reasons == (
        "hmac: the signing key ${GPUHEDGE_TEST_UNSET_KEY} is not set on this worker",
    )


def test_then_runs_after_the_mac_on_the_field_at():
    good = sign_result({"audio_base64": audio()}, KEY)
    assert check(good, then={"name": "wav", "min_s": 0.5}, at="audio_base64").ok
    silent = sign_result({"audio_base64": audio(amplitude=0.0)}, KEY)
    verdict = check(silent, then="wav", at="audio_base64")
    assert not verdict.ok and verdict.reasons[0].startswith("near-silent")
    # a good WAV without a signature never reaches the WAV check
    unsigned = {"audio_base64": audio()}
    assert check(unsigned, then="wav", at="audio_base64").reasons[0].startswith("signature missing")
    missing = check(good, then="wav", at="audio")
    assert missing.reasons == ("no field 'audio' in the signed payload",)


def test_max_age_refuses_an_old_or_undated_signature():
    now = 2_000_000_000
    fresh = sign_result({"t": 1}, KEY, timestamp=True)
    assert check(fresh, max_age_s=60).ok
    old = sign_result({"t": 1}, KEY, timestamp=True, now=now - 10**9)
    assert check(old, max_age_s=60).reasons[0].startswith("signed ")
    assert "beyond max_age_s 60" in check(old, max_age_s=60).reasons[0]
    undated = sign_result({"t": 1}, KEY)
    assert check(undated, max_age_s=60).reasons == (
        "signature carries no 'signed_at' time (max_age_s is set)",
    )
    # signed_at is signed: moving it forward breaks the signature
    assert check({**old, "signed_at": now}, max_age_s=60).reasons == ("signature does not match",)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"key": KEY}, "validator 'hmac': key: expected a ${VAR} reference"),
        ({}, "validator 'hmac': key: required"),
        ({"key": REF, "then": "nope"}, "then: unknown validator 'nope'"),
        ({"key": REF, "then": {"name": "wav", "loud": 1}}, "then: bad options for validator 'wav'"),
        ({"key": REF, "at": "audio"}, "at: expected a dotted path, with then naming"),
        ({"key": REF, "max_age_s": 0}, "max_age_s: expected a number > 0"),
        ({"key": REF, "colour": "red"}, "bad options for validator 'hmac'"),
    ],
)
def test_bad_options_are_one_line_in_the_config_and_in_a_call(options, message):
    from gpuhedge_celery.race.spec import build_spec

    block = "{" + ", ".join(f"{k}: {v!r}" for k, v in {"name": "hmac", **options}.items()) + "}"
    with pytest.raises(ConfigError) as caught:
        parse_config_text(f"{SIM}validator: {block}\n", source="v.yaml")
    line = str(caught.value)
    assert line.startswith("v.yaml: validator: ") and message in line and "\n" not in line
    assert KEY not in line
    with pytest.raises(ConfigError) as called:
        build_spec(parse_config_text(SIM), validator={"name": "hmac", **options})
    assert str(called.value).startswith("validator: ") and message in str(called.value)
    assert KEY not in str(called.value)


def test_the_race_keeps_the_reference_not_the_key():
    from gpuhedge_celery.race.spec import build_spec

    cfg = parse_config_text(f"{SIM}validator: {{name: hmac, key: '{REF}', then: wav}}\n")
    spec = build_spec(cfg).to_dict()
    assert spec["validator_options"] == {"key": REF, "then": "wav"}
    assert KEY not in repr(spec)


def test_the_signing_helper_imports_no_celery_redis_or_numpy():
    code = (
        "import sys, gpuhedge_celery.signing as s; "
        "s.sign_result({'a': 1}, 'k' * 16); "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('celery', 'kombu', 'redis', 'httpx', 'numpy', 'yaml')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_short_key_is_refused_by_the_helper():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        sign_result({"a": 1}, "short")
