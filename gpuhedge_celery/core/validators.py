"""Result validators: decide whether a provider's payload is a usable answer.

A race is won by the first *valid* result, so validators are the referee. Each validator is a
plain function ``fn(payload, **options) -> ValidationResult`` registered under a name; configs
and requests choose one by name (``wav``, ``json``, ``nonempty``, ``hmac``, or a user's own)::

    @validator("has_text")
    def has_text(payload, **options):
        return ValidationResult.check(bool(payload.get("text")), "no text in the payload")

Pure code: the standard library and numpy (the ``wav`` validator's audio statistics are
vectorised; a completed attempt is validated once, by the process that fetched its result, and
its verdict is stored beside the result, so nothing decodes the audio again).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import struct
import sys
import wave
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import validators_signed as _signed  # noqa: F401 - registers ``hmac``
from .validator_registry import (  # _REGISTRY: the one dict, for tests that swap a validator
    _REGISTRY,
    OptionCheck,
    ValidationResult,
    ValidatorFn,
    available_validators,
    get_validator,
    option_check,
    options_problem,
    validate,
    validator,
)

__all__ = [
    "_REGISTRY",
    "OptionCheck",
    "ValidationResult",
    "ValidatorFn",
    "available_validators",
    "get_validator",
    "option_check",
    "options_problem",
    "read_wav",
    "tone_wav",
    "validate",
    "validator",
]


# --- nonempty -------------------------------------------------------------------------------


@validator("nonempty")
def nonempty(payload: Any) -> ValidationResult:
    """Accept anything but ``None``, empty or whitespace-only strings/bytes and empty containers."""
    if payload is None:
        return ValidationResult.failed("payload is missing (None)")
    if isinstance(payload, (str, bytes, bytearray)) and not payload.strip():
        return ValidationResult.failed("payload is empty")
    if isinstance(payload, (Mapping, Sequence)) and len(payload) == 0:
        return ValidationResult.failed("payload is an empty container")
    return ValidationResult.passed()


# --- json -----------------------------------------------------------------------------------


@validator("json")
def json_payload(payload: Any, required: Sequence[str] = ()) -> ValidationResult:
    """Accept a JSON document (text, bytes, or already-parsed dict/list); ``required`` top keys."""
    if isinstance(payload, (bytes, bytearray)):
        try:
            payload = payload.decode("utf-8")
        except UnicodeDecodeError:
            return ValidationResult.failed("payload is not UTF-8 text")
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except ValueError as e:
            return ValidationResult.failed(f"payload is not valid JSON: {e}")
    elif not isinstance(payload, (dict, list, int, float, bool)) and payload is not None:
        return ValidationResult.failed(f"payload is a {type(payload).__name__}, not JSON")
    if required:
        if not isinstance(payload, dict):
            return ValidationResult.failed("payload is not a JSON object")
        missing = [k for k in required if k not in payload]
        if missing:
            return ValidationResult.failed(f"missing keys: {', '.join(missing)}")
    return ValidationResult.passed()


# --- wav ------------------------------------------------------------------------------------


@dataclass
class _Audio:
    sample_rate: int
    channels: int
    frames: int
    samples: np.ndarray  # interleaved float64 samples, in [-1, 1] for PCM


def _wav_bytes(payload: Any) -> bytes:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload)
    if isinstance(payload, str):
        text = payload.strip()
        if text.startswith("data:") and "," in text:  # data:audio/wav;base64,....
            text = text.split(",", 1)[1]
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"payload is not base64: {e}") from e
    raise ValueError(f"payload is a {type(payload).__name__}, expected WAV bytes or base64 text")


def _pcm_to_floats(raw: bytes, width: int) -> np.ndarray:
    """Interleaved PCM ints to float64 in [-1, 1) (WAV is little-endian; 8-bit is unsigned).
    A trailing partial sample is dropped."""
    raw = raw[: len(raw) // width * width]
    if width == 1:
        return (np.frombuffer(raw, dtype=np.uint8).astype(np.float64) - 128.0) / 128.0
    if width == 3:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3)
        ints = b[:, 0].astype(np.int32) | (b[:, 1].astype(np.int32) << 8)
        ints |= b[:, 2].astype(np.int8).astype(np.int32) << 16
        return ints.astype(np.float64) / float(1 << 23)
    dtype = {2: "<i2", 4: "<i4"}[width]
    return np.frombuffer(raw, dtype=dtype).astype(np.float64) / float(1 << (8 * width - 1))


def _read_riff(data: bytes) -> _Audio:
    """Parse WAVs the stdlib ``wave`` module refuses before 3.12: IEEE float (format 3) and
    WAVE_FORMAT_EXTENSIBLE wrapping PCM or float."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a RIFF/WAVE file")
    pos, fmt, payload = 12, None, None
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        body = data[pos + 8 : pos + 8 + size]
        if cid == b"fmt " and len(body) >= 16:
            fmt = body
        elif cid == b"data":
            payload = body
        pos += 8 + size + (size & 1)
    if fmt is None or payload is None:
        raise ValueError("not a WAV file: no fmt or data chunk")
    tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == 0xFFFE and len(fmt) >= 26:  # the real format code opens the sub-format GUID
        tag = struct.unpack("<H", fmt[24:26])[0]
    if channels < 1 or rate < 1:
        raise ValueError(f"not a WAV file: {channels} channels at {rate} Hz")
    if tag == 1 and bits in (8, 16, 24, 32):
        samples = _pcm_to_floats(payload, bits // 8)
    elif tag == 3 and bits in (32, 64):
        width = bits // 8
        raw = payload[: len(payload) // width * width]
        samples = np.frombuffer(raw, dtype="<f4" if bits == 32 else "<f8").astype(np.float64)
    else:
        raise ValueError(f"unsupported WAV format tag {tag} with {bits}-bit samples")
    return _Audio(rate, channels, len(samples) // channels, samples)


def tone_wav(
    duration_s: float = 1.0,
    sample_rate: int = 16_000,
    amplitude: float = 0.3,
    freq_hz: float = 220.0,
    channels: int = 1,
) -> bytes:
    """A 16-bit PCM sine-tone WAV: the simulator's payload and the tests' known-good audio."""
    frames = int(round(duration_s * sample_rate))
    peak = 32767
    step = 2 * math.pi * freq_hz / sample_rate
    ints = array("h")
    for i in range(frames):
        v = int(max(-1.0, min(1.0, amplitude * math.sin(step * i))) * peak)
        ints.extend([v] * channels)
    if sys.byteorder == "big":  # pragma: no cover
        ints.byteswap()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(ints.tobytes())
    return buf.getvalue()


def read_wav(payload: Any) -> _Audio:
    """Decode WAV bytes (or base64 text) to interleaved float samples; ``ValueError`` if not WAV."""
    data = _wav_bytes(payload)
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            frames = w.getnframes()
            raw = w.readframes(frames)
    except wave.Error as e:
        if "unknown format" in str(e):
            return _read_riff(data)
        raise ValueError(f"not a WAV file: {e}") from e
    except (EOFError, struct.error) as e:
        raise ValueError(f"truncated WAV file: {e}") from e
    if width not in (1, 2, 3, 4):
        raise ValueError(f"unsupported sample width {width} bytes")
    samples = _pcm_to_floats(raw, width)
    return _Audio(rate, channels, len(samples) // max(channels, 1), samples)


def _audio_stats(audio: _Audio, clip_at: float) -> tuple[bool, float, float]:
    """(has NaN, RMS of the mono mix, fraction of samples with |x| >= clip_at)."""
    n_ch, frames = audio.channels, audio.frames
    x = audio.samples  # (a trailing partial frame counts for NaN and clipping, not the mix)
    if np.isnan(x).any():
        return True, float("nan"), 0.0
    with np.errstate(all="ignore"):  # float WAVs may hold inf or huge values: inf, as in Python
        mono = x[: frames * n_ch].reshape(frames, n_ch).mean(axis=1) if n_ch > 1 else x
        rms = float(np.sqrt(np.mean(mono * mono))) if frames else 0.0
        clipped = float(np.count_nonzero(np.abs(x) >= clip_at)) / max(len(x), 1)
    return False, rms, clipped


@validator("wav")
def wav_payload(
    payload: Any,
    sample_rate: int | None = None,
    min_s: float = 0.5,
    max_s: float = 120.0,
    min_rms: float = 1e-4,
    max_clipped: float = 0.01,
    clip_at: float = 0.999,
) -> ValidationResult:
    """Accept speech-like audio: parseable WAV, 0.5-120 s, audible (mono-mix RMS >= 1e-4),
    at most 1 % of samples clipped at |x| >= 0.999, no NaN, and ``sample_rate`` if given."""
    try:
        audio = read_wav(payload)
    except ValueError as e:
        return ValidationResult.failed(str(e))
    reasons: list[str] = []
    duration = audio.frames / audio.sample_rate if audio.sample_rate else 0.0
    details = {
        "duration_s": round(duration, 4),
        "sample_rate": audio.sample_rate,
        "channels": audio.channels,
    }
    if sample_rate is not None and audio.sample_rate != int(sample_rate):
        reasons.append(f"sample rate {audio.sample_rate} Hz, expected {int(sample_rate)} Hz")
    if duration < min_s:
        reasons.append(f"too short: {duration:.3f} s < {min_s} s")
    elif duration > max_s:
        reasons.append(f"too long: {duration:.3f} s > {max_s} s")
    if audio.frames:
        has_nan, rms, clipped = _audio_stats(audio, clip_at)
        if has_nan:
            reasons.append("samples contain NaN")
        else:
            details.update(rms=rms, clipped_fraction=clipped)
            if rms < min_rms:
                reasons.append(f"near-silent: RMS {rms:.2e} < {min_rms:g}")
            if clipped > max_clipped:
                reasons.append(f"clipped: {clipped:.1%} of samples at |x| >= {clip_at}")
    return ValidationResult(not reasons, tuple(reasons), details)
