"""Validators as tables: good audio passes, each defect is rejected with a reason naming it."""

from __future__ import annotations

import base64
import io
import math
import struct
import wave
from array import array

import pytest

from gpuhedge_celery.core import validators as v
from gpuhedge_celery.errors import ConfigError
from tests.support import wav_reference


def pcm_wav(samples: list[float], rate: int = 16_000, channels: int = 1, width: int = 2) -> bytes:
    """Interleaved floats in [-1, 1] as a PCM WAV of ``width`` bytes per sample."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        if width == 1:
            raw = bytes(max(0, min(255, int(round(x * 127)) + 128)) for x in samples)
        else:
            full = (1 << (8 * width - 1)) - 1
            raw = b"".join(
                int(round(max(-1.0, min(1.0, x)) * full)).to_bytes(width, "little", signed=True)
                for x in samples
            )
        w.writeframes(raw)
    return buf.getvalue()


def float_wav(samples: list[float], rate: int = 16_000, channels: int = 1) -> bytes:
    """An IEEE-float (format 3) WAV, which the stdlib wave module cannot write."""
    data = array("f", samples).tobytes()
    fmt = struct.pack("<HHIIHH", 3, channels, rate, rate * 4 * channels, 4 * channels, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def sine(seconds: float, rate: int = 16_000, amp: float = 0.3) -> list[float]:
    return [amp * math.sin(2 * math.pi * 220 * i / rate) for i in range(int(seconds * rate))]


GOOD = sine(1.0)


def clipped(fraction: float) -> list[float]:
    out = list(GOOD)
    for i in range(int(len(out) * fraction)):
        out[i] = 1.0
    return out


@pytest.fixture(params=["numpy", "stdlib"])
def backend(request, monkeypatch):
    """Run each table row with the validator (numpy) and with the former pure-stdlib validator,
    kept as the reference in tests/support/wav_reference.py."""
    if request.param == "stdlib":
        monkeypatch.setitem(v._REGISTRY, "wav", wav_reference.wav_payload)
    return request.param


WAV_CASES = [
    # (name, payload, options, expect_ok, reason fragment)
    ("good 16-bit", pcm_wav(GOOD), {}, True, None),
    ("good as base64 text", base64.b64encode(pcm_wav(GOOD)).decode(), {}, True, None),
    (
        "good data URL",
        "data:audio/wav;base64," + base64.b64encode(pcm_wav(GOOD)).decode(),
        {},
        True,
        None,
    ),
    ("good 8-bit", pcm_wav(GOOD, width=1), {}, True, None),
    ("good 24-bit", pcm_wav(GOOD, width=3), {}, True, None),
    ("good 32-bit", pcm_wav(GOOD, width=4), {}, True, None),
    ("good stereo", pcm_wav([x for s in GOOD for x in (s, s)], channels=2), {}, True, None),
    ("good float", float_wav(GOOD), {}, True, None),
    ("silent", pcm_wav([0.0] * 16_000), {}, False, "near-silent"),
    ("near-silent", pcm_wav(sine(1.0, amp=2e-5)), {}, False, "near-silent"),
    (
        "stereo cancelling to silence",
        pcm_wav([x for s in GOOD for x in (s, -s)], channels=2),
        {},
        False,
        "near-silent",
    ),
    ("2% clipped", pcm_wav(clipped(0.02)), {}, False, "clipped"),
    ("0.5% clipped is fine", pcm_wav(clipped(0.005)), {}, True, None),
    ("too short", pcm_wav(sine(0.3)), {}, False, "too short"),
    ("too long", pcm_wav(sine(121.0, rate=1_000), rate=1_000), {}, False, "too long"),
    ("wrong rate", pcm_wav(GOOD), {"sample_rate": 24_000}, False, "expected 24000 Hz"),
    ("right rate", pcm_wav(GOOD), {"sample_rate": 16_000}, True, None),
    ("NaN float", float_wav(GOOD[:-10] + [float("nan")] * 10), {}, False, "NaN"),
    ("garbage bytes", b"not a wav at all, just bytes", {}, False, "not a WAV"),
    ("garbage text", "%%% not base64 %%%", {}, False, "not base64"),
    ("truncated", pcm_wav(GOOD)[:30], {}, False, "WAV"),
    ("empty", b"", {}, False, "WAV"),
    ("wrong type", 12345, {}, False, "expected WAV bytes"),
    ("none", None, {}, False, "expected WAV bytes"),
]


@pytest.mark.parametrize(
    "name,payload,options,ok,fragment", WAV_CASES, ids=[c[0] for c in WAV_CASES]
)
def test_wav_table(backend, name, payload, options, ok, fragment):
    result = v.validate("wav", payload, **options)
    assert result.ok is ok, result.reasons
    if fragment:
        assert any(fragment in r for r in result.reasons), result.reasons
    else:
        assert result.reasons == ()


def test_wav_reports_measurements(backend):
    result = v.validate("wav", pcm_wav(GOOD))
    assert result.details["duration_s"] == pytest.approx(1.0)
    assert result.details["rms"] == pytest.approx(0.3 / math.sqrt(2), rel=1e-3)
    assert result.details["clipped_fraction"] == 0.0


def test_tone_wav_is_valid_and_silent_tone_is_not():
    assert v.validate("wav", v.tone_wav(1.0))
    assert not v.validate("wav", v.tone_wav(1.0, amplitude=1e-6))


JSON_CASES = [
    ('{"a": 1}', {}, True),
    (b"[1, 2]", {}, True),
    ({"a": 1}, {}, True),
    ("{not json", {}, False),
    (b"\xff\xfe", {}, False),
    (object(), {}, False),
    ('{"a": 1}', {"required": ["a"]}, True),
    ('{"a": 1}', {"required": ["a", "b"]}, False),
    ("[1]", {"required": ["a"]}, False),
]


@pytest.mark.parametrize("payload,options,ok", JSON_CASES)
def test_json_table(payload, options, ok):
    assert v.validate("json", payload, **options).ok is ok


@pytest.mark.parametrize(
    "payload,ok",
    [
        ("x", True),
        (b"\x00", True),
        ([0], True),
        ({"k": 0}, True),
        (0, True),
        (None, False),
        ("", False),
        ("  \n", False),
        (b"", False),
        ([], False),
        ({}, False),
    ],
)
def test_nonempty_table(payload, ok):
    assert v.validate("nonempty", payload).ok is ok


def test_user_validator_registry():
    @v.validator("test_has_text")
    def has_text(payload, min_len=1):
        return v.ValidationResult.check(len(payload.get("text", "")) >= min_len, "text too short")

    @v.validator("test_bool")
    def as_bool(payload):
        return payload == "yes"

    @v.validator("test_crash")
    def crash(payload):
        raise RuntimeError("boom")

    assert "test_has_text" in v.available_validators()
    assert v.validate("test_has_text", {"text": "hi"})
    assert v.validate("test_has_text", {"text": "hi"}, min_len=3).reasons == ("text too short",)
    assert v.validate("test_bool", "yes") and not v.validate("test_bool", "no")
    crashed = v.validate("test_crash", "x")
    assert not crashed and "RuntimeError: boom" in crashed.reasons[0]


def test_unknown_validator_and_bad_option_are_config_errors():
    with pytest.raises(ConfigError, match="unknown validator 'nope'.*known: .*wav"):
        v.validate("nope", b"")
    with pytest.raises(ConfigError, match="validator 'wav'"):
        v.validate("wav", pcm_wav(GOOD), rate=16_000)


def test_result_round_trips_to_dict():
    result = v.ValidationResult.failed("a", "b", x=1)
    assert result.to_dict() == {"ok": False, "reasons": ["a", "b"], "details": {"x": 1}}
    assert not result
