"""The ``wav`` validator's numpy statistics give the verdicts of the former pure-Python code.

Generated WAVs of every kind the validator reads (8/16/24/32-bit PCM, 32/64-bit float, 1-3
channels) with silence, tones, noise, clipping, NaN and infinities, and broken ones (wrong
headers, truncated data), go through both: the production validator and the reference in
tests/support/wav_reference.py. Same ``ok``, same reasons, same details (RMS to the last few
bits: numpy sums pairwise where the reference sums exactly).
"""

from __future__ import annotations

import math
import random
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuhedge_celery.core import validators as v
from tests.support import wav_reference

PCM_WIDTHS = (1, 2, 3, 4)


def riff(fmt_tag: int, channels: int, rate: int, bits: int, data: bytes, extensible=False) -> bytes:
    """A RIFF/WAVE file with one fmt and one data chunk (any format the validator reads)."""
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 0xFFFE if extensible else fmt_tag, channels, rate,
                      rate * block, block, bits)  # fmt: skip
    if extensible:  # cbSize, valid bits, channel mask, then the sub-format GUID's first 2 bytes
        fmt += struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", fmt_tag) + b"\x00" * 14
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data + (b"\x00" if len(data) & 1 else b"")
    return b"RIFF" + struct.pack("<I", len(body)) + body


def encode(samples: list[float], kind: str) -> tuple[int, int, bytes]:
    """(format tag, bits, little-endian sample bytes) for floats in about [-1, 1]."""
    if kind.startswith("f"):
        bits = int(kind[1:])
        return 3, bits, struct.pack(f"<{len(samples)}{'f' if bits == 32 else 'd'}", *samples)
    width = int(kind[1:]) // 8
    if width == 1:
        return 1, 8, bytes(max(0, min(255, int(round(x * 127)) + 128)) for x in samples)
    full = (1 << (8 * width - 1)) - 1
    out = b"".join(
        max(-full - 1, min(full, int(round(x * full)))).to_bytes(width, "little", signed=True)
        for x in samples
    )
    return 1, 8 * width, out


def signal(shape: str, n: int, rng: random.Random, amp: float) -> list[float]:
    if shape == "silence":
        return [0.0] * n
    if shape == "tone":
        freq = rng.uniform(50, 2000)
        return [amp * math.sin(2 * math.pi * freq * i / 16_000) for i in range(n)]
    if shape == "noise":
        return [rng.uniform(-amp, amp) for _ in range(n)]
    if shape == "clipping":
        return [max(-1.0, min(1.0, 3 * amp * math.sin(i / 7.0))) for i in range(n)]
    if shape == "square":  # every sample at full scale
        return [1.0 if (i // 40) % 2 else -1.0 for i in range(n)]
    raise AssertionError(shape)


def reference_verdict(payload, **options) -> v.ValidationResult:
    """``validate("wav", ...)`` with the reference in the registry (so a validator that raises
    is reported as the validator's does)."""
    production = v._REGISTRY["wav"]
    v._REGISTRY["wav"] = wav_reference.wav_payload
    try:
        return v.validate("wav", payload, **options)
    finally:
        v._REGISTRY["wav"] = production


def same_verdict(payload, **options) -> None:
    new = v.validate("wav", payload, **options)
    old = reference_verdict(payload, **options)
    assert new.ok == old.ok, (new, old)
    assert new.reasons == old.reasons, (new, old)
    assert set(new.details) == set(old.details), (new, old)
    for key, want in old.details.items():
        got = new.details[key]
        if key == "rms" and math.isfinite(want):
            assert got == pytest.approx(want, rel=1e-12, abs=1e-300), (new, old)
        elif isinstance(want, float) and math.isnan(want):
            assert math.isnan(got), (new, old)
        else:
            assert got == want, (key, new, old)


WAV = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["i8", "i16", "i24", "i32", "f32", "f64"]),
        "channels": st.integers(1, 3),
        "rate": st.sampled_from([1_000, 8_000, 16_000, 22_050]),
        "seconds": st.sampled_from([0.0, 0.01, 0.3, 0.5, 1.0]),
        "shape": st.sampled_from(["silence", "tone", "noise", "clipping", "square"]),
        "amp": st.sampled_from([1e-6, 2e-5, 1e-4, 0.01, 0.3, 0.999, 1.0]),
        "extensible": st.booleans(),
        "seed": st.integers(0, 2**16),
        "specials": st.lists(st.sampled_from(["nan", "inf", "-inf", "huge"]), max_size=2),
    }
)
OPTIONS = st.sampled_from(
    [{}, {"sample_rate": 16_000}, {"min_s": 0.0}, {"max_clipped": 0.0, "clip_at": 0.5},
     {"min_rms": 0.1}, {"max_s": 0.4}]
)  # fmt: skip


def build(wav: dict) -> bytes:
    rng = random.Random(wav["seed"])
    frames = int(wav["rate"] * wav["seconds"])
    samples = signal(wav["shape"], frames * wav["channels"], rng, wav["amp"])
    if wav["kind"].startswith("f") and samples:
        for special in wav["specials"]:  # only a float WAV can carry these
            value = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "huge": 1e200}[special]
            if wav["kind"] == "f32" and special == "huge":
                value = 3e38
            samples[rng.randrange(len(samples))] = value
    tag, bits, data = encode(samples, wav["kind"])
    return riff(tag, wav["channels"], wav["rate"], bits, data, wav["extensible"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wav=WAV, options=OPTIONS)
def test_generated_wavs_get_the_reference_verdict(wav, options):
    same_verdict(build(wav), **options)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wav=WAV, cut=st.floats(0.0, 1.0), flips=st.lists(st.integers(0, 60), max_size=4))
def test_truncated_and_corrupted_wavs_get_the_reference_verdict(wav, cut, flips):
    data = bytearray(build(wav))
    for at in flips:  # wrong header bytes: tags, sizes, channel counts, rates, widths
        if at < len(data):
            data[at] ^= 0x5A
    same_verdict(bytes(data[: int(len(data) * cut) if cut < 1.0 else len(data)]))


@pytest.mark.parametrize(
    "payload",
    [
        v.tone_wav(1.0),
        v.tone_wav(1.0, amplitude=1e-6),  # the sim's silent WAV
        v.tone_wav(0.2),
        v.tone_wav(1.0, channels=2),
        v.tone_wav(1.0, amplitude=1.0),  # clipped peaks
        riff(1, 1, 16_000, 16, b"\x01"),  # a data chunk shorter than one sample
        riff(1, 1, 16_000, 12, b"\x00" * 100),  # a sample width the validator cannot read
        riff(3, 1, 16_000, 16, b"\x00" * 100),  # a 16-bit float
        riff(1, 0, 16_000, 16, b"\x00" * 100),  # no channels
        b"RIFF\x00\x00\x00\x00WAVEjunk",
        b"",
        "not base64 %%%",
    ],
)
def test_known_wavs_get_the_reference_verdict(payload):
    same_verdict(payload)
