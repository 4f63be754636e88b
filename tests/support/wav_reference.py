"""The ``wav`` validator's former pure-Python statistics: the reference the numpy code is held to.

The production validator (``gpuhedge_celery/core/validators.py``) decodes samples and computes
its statistics with numpy. This module keeps the earlier standard-library implementation of the
same steps (sample decoding, IEEE-float parsing, NaN / RMS / clipping), used only by the tests,
which require both to give the same verdict on every WAV they generate.
"""

from __future__ import annotations

import io
import math
import struct
import sys
import wave
from array import array
from typing import Any

from gpuhedge_celery.core.validators import ValidationResult, _Audio, _wav_bytes


def pcm_to_floats(raw: bytes, width: int) -> list[float]:
    if width == 1:
        return [(b - 128) / 128.0 for b in raw]
    if width == 3:
        scale = float(1 << 23)
        return [
            int.from_bytes(raw[i : i + 3], "little", signed=True) / scale
            for i in range(0, len(raw) - 2, 3)
        ]
    ints = array({2: "h", 4: "i"}[width])
    ints.frombytes(raw[: len(raw) // width * width])
    if sys.byteorder == "big":  # pragma: no cover
        ints.byteswap()
    scale = float(1 << (8 * width - 1))
    return [x / scale for x in ints]


def read_riff(data: bytes) -> _Audio:
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
    if tag == 0xFFFE and len(fmt) >= 26:
        tag = struct.unpack("<H", fmt[24:26])[0]
    if channels < 1 or rate < 1:
        raise ValueError(f"not a WAV file: {channels} channels at {rate} Hz")
    if tag == 1 and bits in (8, 16, 24, 32):
        samples: Any = pcm_to_floats(payload, bits // 8)
    elif tag == 3 and bits in (32, 64):
        samples = array("f" if bits == 32 else "d")
        samples.frombytes(payload[: len(payload) // (bits // 8) * (bits // 8)])
        if sys.byteorder == "big":  # pragma: no cover
            samples.byteswap()
        samples = list(samples)
    else:
        raise ValueError(f"unsupported WAV format tag {tag} with {bits}-bit samples")
    return _Audio(rate, channels, len(samples) // channels, samples)


def read_wav(payload: Any) -> _Audio:
    data = _wav_bytes(payload)
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            frames = w.getnframes()
            raw = w.readframes(frames)
    except wave.Error as e:
        if "unknown format" in str(e):
            return read_riff(data)
        raise ValueError(f"not a WAV file: {e}") from e
    except (EOFError, struct.error) as e:
        raise ValueError(f"truncated WAV file: {e}") from e
    if width not in (1, 2, 3, 4):
        raise ValueError(f"unsupported sample width {width} bytes")
    samples = pcm_to_floats(raw, width)
    return _Audio(rate, channels, len(samples) // max(channels, 1), samples)


def audio_stats(audio: _Audio, clip_at: float) -> tuple[bool, float, float]:
    n_ch, frames = audio.channels, audio.frames
    x = audio.samples
    if any(v != v for v in x):  # NaN is the only value not equal to itself
        return True, float("nan"), 0.0
    if n_ch == 1:
        mono = x
    else:
        mono = [sum(x[i : i + n_ch]) / n_ch for i in range(0, frames * n_ch, n_ch)]
    rms = math.sqrt(math.fsum(v * v for v in mono) / frames) if frames else 0.0
    clipped = sum(1 for v in x if abs(v) >= clip_at) / max(len(x), 1)
    return False, rms, clipped


def wav_payload(
    payload: Any,
    sample_rate: int | None = None,
    min_s: float = 0.5,
    max_s: float = 120.0,
    min_rms: float = 1e-4,
    max_clipped: float = 0.01,
    clip_at: float = 0.999,
) -> ValidationResult:
    """The former ``wav`` validator, line for line, on the pure-Python steps above."""
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
        has_nan, rms, clipped = audio_stats(audio, clip_at)
        if has_nan:
            reasons.append("samples contain NaN")
        else:
            details.update(rms=rms, clipped_fraction=clipped)
            if rms < min_rms:
                reasons.append(f"near-silent: RMS {rms:.2e} < {min_rms:g}")
            if clipped > max_clipped:
                reasons.append(f"clipped: {clipped:.1%} of samples at |x| >= {clip_at}")
    return ValidationResult(not reasons, tuple(reasons), details)
