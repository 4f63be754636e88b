"""One provider's entry in the YAML config (``providers.<name>``), as plain data.

It sits below everything else in :mod:`gpuhedge_celery.providers` and imports none of it, so the
provider contract (``base.py``), each adapter and the registry can all name it without an import
cycle through :mod:`gpuhedge_celery.config`. The registry parses an entry
(:func:`~gpuhedge_celery.providers.registry.parse_provider`); the config module re-exports both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ROLES = ("primary", "hedge", "fallback")


@dataclass(frozen=True)
class ProviderConfig:
    """One entry of ``providers:``. ``options`` is the adapter block as written (``${VAR}``
    unresolved), ``spec`` the adapter's parsed form of it."""

    name: str
    adapter: str
    role: str = "primary"
    gpu: str | None = None
    billed_rate_per_s: float = 0.0
    idle_billed_seconds: float = 0.0
    deployed: bool = True
    timeout_s: float | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    spec: Any = None
    time_scale: float = 1.0
    source: str | None = None

    def renamed(self, name: str) -> ProviderConfig:
        return dataclasses.replace(self, name=name)

    def __repr__(self) -> str:
        # adapter blocks may hold secrets (headers): show their keys, never their values
        return (
            f"ProviderConfig(name={self.name!r}, adapter={self.adapter!r}, role={self.role!r}, "
            f"gpu={self.gpu!r}, billed_rate_per_s={self.billed_rate_per_s!r}, "
            f"idle_billed_seconds={self.idle_billed_seconds!r}, deployed={self.deployed!r}, "
            f"options=<keys {sorted(self.options)}>)"
        )
