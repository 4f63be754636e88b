"""Configuration of the ``sim`` adapter: latency distributions, outcome odds, time scale.

YAML (every key optional)::

    sim:
      seed: 7
      time_scale: 0.1             # real seconds per provider second
      slow_probability: 0.3       # bimodal: fast mode or slow mode
      fast: {queue_s: [1.1, 2.0], run_s: [3.8, 5.0]}
      slow: {queue_s: [9, 27], run_s: {lognormal: {median: 85, sigma: 0.1}}}
      invalid_probability: 0.05   # completes with a near-silent WAV
      fail_probability: 0.0       # ends FAILED
      cancel: {ack_s: 0.28, terminal_s: 0.35}
      reports_queue_state: true   # false: QUEUED is reported as IN_PROGRESS (like Modal)
      audio: {seconds: 1.0, sample_rate: 16000}

A distribution is a number (constant), ``[low, high]`` (uniform) or ``{lognormal: {median,
sigma}}``; draws are clamped at 0.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from .options import Block


@dataclass(frozen=True)
class Dist:
    """A non-negative random duration: constant, uniform or lognormal."""

    kind: str = "constant"
    a: float = 0.0
    b: float = 0.0

    def draw(self, rng: random.Random) -> float:
        """One draw; always consumes exactly one value from ``rng`` (stable sequences)."""
        u = rng.random()
        if self.kind == "uniform":
            return self.a + (self.b - self.a) * u
        if self.kind == "lognormal":
            # inverse-CDF of a normal from one uniform keeps the draw count fixed
            z = _norm_ppf(min(max(u, 1e-12), 1 - 1e-12))
            return max(0.0, self.a * math.exp(self.b * z))
        return self.a

    def upper(self) -> float:
        """The longest draw possible (infinite for a lognormal)."""
        if self.kind == "lognormal":
            return math.inf
        return max(self.a, self.b)

    @classmethod
    def parse(cls, block: Block, name: str, default: Dist) -> Dist:
        value = block.raw(name, None)
        if value is None:
            return default
        where = block.key(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            return cls("constant", float(value), float(value))
        if (
            isinstance(value, list)
            and len(value) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
            and 0 <= value[0] <= value[1]
        ):
            return cls("uniform", float(value[0]), float(value[1]))
        if isinstance(value, dict) and set(value) == {"lognormal"}:
            inner = Block(value["lognormal"], f"{where}.lognormal", block.file)
            median = inner.number("median", positive=True)
            sigma = inner.number("sigma", minimum=0.0)
            inner.finish()
            return cls("lognormal", median, sigma)
        raise block.error(
            name,
            "expected seconds as a number >= 0, [low, high] with 0 <= low <= high, or "
            f"{{lognormal: {{median, sigma}}}}, got {value!r}",
        )


def _norm_ppf(p: float) -> float:
    """Standard normal quantile (Acklam's rational approximation, |error| < 1.2e-9)."""
    a = (
        -3.969683028665376e01,
        2.209460984245205e02,
        -2.759285104469687e02,
        1.383577518672690e02,
        -3.066479806614716e01,
        2.506628277459239e00,
    )
    b = (
        -5.447609879822406e01,
        1.615858368580409e02,
        -1.556989798598866e02,
        6.680131188771972e01,
        -1.328068155288572e01,
    )
    c = (
        -7.784894002430293e-03,
        -3.223964580411365e-01,
        -2.400758277161838e00,
        -2.549732539343734e00,
        4.374664141464968e00,
        2.938163982698783e00,
    )
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    if p < 0.02425:
        q = math.sqrt(-2 * math.log(p))
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
            (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1
        )
    if p > 1 - 0.02425:
        return -_norm_ppf(1 - p)
    q = p - 0.5
    r = q * q
    num = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q
    return num / (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)


@dataclass(frozen=True)
class SimMode:
    """One latency mode: queue (time before a worker starts) and run (execution) durations."""

    queue_s: Dist
    run_s: Dist


_FAST = SimMode(Dist("uniform", 1.1, 2.0), Dist("uniform", 3.8, 5.0))
_SLOW = SimMode(Dist("uniform", 9.0, 27.0), Dist("uniform", 80.0, 95.0))


@dataclass(frozen=True)
class SimSpec:
    """Everything that shapes a sim provider's jobs; see the module docstring for the YAML."""

    seed: int = 0
    time_scale: float = 1.0
    slow_probability: float = 0.0
    fast: SimMode = _FAST
    slow: SimMode = _SLOW
    invalid_probability: float = 0.0
    fail_probability: float = 0.0
    cancel_ack_s: float = 0.28
    cancel_terminal_s: float = 0.35
    reports_queue_state: bool = True
    audio_s: float = 1.0
    sample_rate: int = 16_000
    poll_s: float = 0.05  # real seconds between ledger re-reads while waiting for a result

    def longest_job_s(self) -> float:
        """Real seconds the slowest possible job takes (queue plus run, in the slowest mode it
        can draw); infinite when a duration is lognormal (then only the attempt cap bounds it)."""
        modes = [self.fast] + ([self.slow] if self.slow_probability > 0 else [])
        longest = max(m.queue_s.upper() + m.run_s.upper() for m in modes)
        return longest * self.time_scale

    def draw(self, key: str) -> dict[str, Any]:
        """The fate of the job with ``key`` (mode, queue_s, run_s in provider seconds, outcome):
        same seed and key, same fate, in every process."""
        rng = random.Random(f"{self.seed}:{key}")
        slow = rng.random() < self.slow_probability
        mode = self.slow if slow else self.fast
        queue_s = mode.queue_s.draw(rng)
        run_s = mode.run_s.draw(rng)
        u = rng.random()
        if u < self.fail_probability:
            outcome = "failed"
        elif u < self.fail_probability + self.invalid_probability:
            outcome = "invalid"
        else:
            outcome = "ok"
        return {
            "key": key,
            "slow": slow,
            "queue_s": round(queue_s, 6),
            "run_s": round(run_s, 6),
            "outcome": outcome,
        }

    @classmethod
    def from_block(cls, block: Block, *, time_scale: float | None = None) -> SimSpec:
        """Read a ``sim:`` block; ``time_scale`` is the config-wide default for the block's."""
        default_scale = 1.0 if time_scale is None else time_scale
        fast, slow = block.mapping("fast"), block.mapping("slow")
        modes = []
        for mode, default in ((fast, _FAST), (slow, _SLOW)):
            modes.append(
                SimMode(
                    Dist.parse(mode, "queue_s", default.queue_s),
                    Dist.parse(mode, "run_s", default.run_s),
                )
            )
            mode.finish()
        cancel, audio = block.mapping("cancel"), block.mapping("audio")
        spec = cls(
            seed=block.number("seed", 0, integer=True),
            time_scale=block.number("time_scale", default_scale, positive=True),
            slow_probability=block.number("slow_probability", 0.0, minimum=0.0, maximum=1.0),
            fast=modes[0],
            slow=modes[1],
            invalid_probability=block.number("invalid_probability", 0.0, minimum=0, maximum=1),
            fail_probability=block.number("fail_probability", 0.0, minimum=0.0, maximum=1.0),
            cancel_ack_s=cancel.number("ack_s", 0.28, minimum=0.0),
            cancel_terminal_s=cancel.number("terminal_s", 0.35, minimum=0.0),
            reports_queue_state=block.boolean("reports_queue_state", True),
            audio_s=audio.number("seconds", 1.0, positive=True),
            sample_rate=audio.number("sample_rate", 16_000, integer=True, minimum=1000),
            poll_s=block.number("poll_s", 0.05, positive=True),
        )
        cancel.finish()
        audio.finish()
        if spec.invalid_probability + spec.fail_probability > 1.0:
            raise block.error("invalid_probability", "invalid + fail probabilities exceed 1")
        if spec.cancel_ack_s > spec.cancel_terminal_s:
            raise cancel.error("ack_s", "expected ack_s <= terminal_s")
        block.finish()
        return spec
