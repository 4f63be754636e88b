"""What providers charge: a rate per second of execution and an idle window per worker start."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class ProviderRate:
    """What one provider charges: USD per second of execution and an idle window per start."""

    rate_per_s: float
    idle_s: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_per_s < 0 or self.idle_s < 0:
            raise ConfigError(f"rates must be >= 0, got {self.rate_per_s}/s and {self.idle_s} s")


#: The rates GPUHedge's published tables used (USD per second; RunPod bills a 60 s idle window).
PUBLISHED_RATES: dict[str, ProviderRate] = {
    "runpod": ProviderRate(0.000306, 60.0),
    "modal": ProviderRate(0.000704),
    "cerebrium": ProviderRate(0.000736),
}
