"""Settings of distributed races (the race section of :func:`gpuhedge_celery.settings.current`).

Parsed from ``GPUHEDGE_*`` variables by :func:`gpuhedge_celery.envvars.race_values`; each is
described in docs/configuration.md (*Environment variables*). Values are mirrored into the
Celery configuration as ``gpuhedge_race_<name>``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from .. import envvars
from ..errors import ConfigError
from ..plugins import MODULE_RE


@dataclass(frozen=True)
class RaceSettings:
    """Everything the race coordinator reads from the environment."""

    receipt_ttl_s: float = 86400.0
    payload_inline_max: int = 1_000_000
    payload_by_ref: bool = True
    request_max_bytes: int = 1_048_576
    watch_interval_s: float = 1.0
    events: bool = True
    event_linger_ms: float = 100.0
    ack_linger_ms: float = 250.0
    timer_namespace: str = "races"
    # Shards races and their timers are spread over (store/race_keys.py RaceShards); every
    # process of a deployment must use the same count, or races are looked for on wrong slots.
    race_shards: int = 1
    launch_backstop_s: float = 60.0
    timer_threads: int = 16
    timer_ahead_ms: int = 25
    cancel_threads: int = 32
    cancel_backstop_s: float = 30.0
    switch_interval_ms: float = 1.0
    plugins: tuple[str, ...] = field(default_factory=tuple)
    records_maxlen: int = 100_000
    events_show_request: bool = False

    def as_celery_conf(self) -> dict[str, object]:
        """The values as ``gpuhedge_race_*`` Celery settings (visible in ``inspect conf``)."""
        return {f"gpuhedge_race_{k}": v for k, v in asdict(self).items()}

    def import_plugins(self) -> None:
        """Import every plugin module (each registers its policies/validators on import)."""
        from ..plugins import load

        load(self.plugins, key=envvars.PLUGINS_VAR)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RaceSettings:
        """Read and validate them from ``environ`` now (this process's environment by
        default); code running in a worker takes ``settings.current().race`` instead."""
        values = envvars.race_values(os.environ if environ is None else environ)
        for module in values["plugins"]:
            if not MODULE_RE.match(module):
                raise ConfigError(
                    f"expected a module path, got {module!r}", key=envvars.PLUGINS_VAR
                )
        return cls(**values)
