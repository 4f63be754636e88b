"""Settings of distributed races (``GPUHEDGE_*`` environment variables), read once, validated.

=================================  ==========  ===============================================
variable                           default     meaning
=================================  ==========  ===============================================
GPUHEDGE_RECEIPT_TTL_S             86400       how long a finished race's receipt (and its
                                               keys) stay readable in Redis
GPUHEDGE_PAYLOAD_INLINE_MAX        1000000     payloads larger than this many bytes (as JSON)
                                               are kept in Redis and the result carries a
                                               ``payload_ref`` instead
GPUHEDGE_PAYLOAD_BY_REF            1           the caller's Celery result refers to the
                                               winner's stored result instead of copying its
                                               payload (Redis receives it once); gpuhedge's
                                               app puts it back inline on ``.get()``; 0:
                                               inline in the stored result too (for other
                                               apps' plain Redis backends)
GPUHEDGE_REQUEST_MAX_BYTES         1048576     the largest request (as compact JSON) a race
                                               accepts; a larger one fails at once with a
                                               one-line ConfigError, before any provider is
                                               called (send a reference, e.g. a URL, instead)
GPUHEDGE_WATCH_INTERVAL_S          1.0         status-poll period for providers that cannot
                                               tell when their job will next change state
GPUHEDGE_RACE_EVENTS               1           send Celery task events (Flower) for races
GPUHEDGE_EVENT_LINGER_MS           100         how long a process gathers race events before
                                               publishing them as one message (events reach
                                               Flower up to this much later; under load one
                                               publish carries many events: 1.4 publishes
                                               per race at 20 ms, 0.4 at 100, measured); 0:
                                               at once
GPUHEDGE_ACK_LINGER_MS             250         how long a coordination task's broker
                                               acknowledgement may wait to ride in the next
                                               delivery's round trip (a flush sends what is
                                               left after this long); a crash in between
                                               only redelivers an idempotent task after the
                                               visibility timeout; 0: each sent at once
GPUHEDGE_TIMER_NAMESPACE           races       the durable-timer namespace races use
GPUHEDGE_SUBMIT_PRIMARY_INLINE     1           hedged_infer submits the first attempt
                                               itself instead of through a race_submit task
GPUHEDGE_LAUNCH_INLINE             1           a race submits the attempts it launches later
                                               (hedges, fallbacks) on the deciding process's
                                               launch threads, behind a durable backstop
                                               timer; 0: through race_submit tasks
GPUHEDGE_LAUNCH_BACKSTOP_S         60          a launch on a process that died is taken over
                                               by any live worker's timers after this long;
                                               a submit still in flight then ends as "outcome
                                               unknown" (never submitted twice), so keep it
                                               longer than any provider's submit (connect +
                                               read timeout)
GPUHEDGE_TIMER_THREADS             16          threads per process that run due timers (race
                                               steps, status polls, backstop cancels); a
                                               handler waits on Redis and providers, so a
                                               burst needs them overlapped (8 fell seconds
                                               behind at 5,000 races in flight, measured)
GPUHEDGE_COORD_LOOP                batched     ``batched``: the timer thread steps each claimed
                                               batch of watch polls in memory and saves them
                                               in one round trip, handing the rest to the
                                               timer threads; ``threads``: every timer on a
                                               timer thread (docs/architecture.md compares
                                               the two)
GPUHEDGE_TIMER_AHEAD_MS            25          a timer claim also takes timers due within this
                                               many ms, each fired at its due time: one claim
                                               per window of timers, not one per timer and
                                               claiming process (claims per race 5-6 at 0,
                                               2.7 at 10, 1.45 at 25 on two workers,
                                               measured); 0: off
GPUHEDGE_CANCEL_THREADS            32          threads per process that call providers' native
                                               cancels the moment a race decides them (and as
                                               many again for inline launches' submits)
GPUHEDGE_CANCEL_BACKSTOP_S         30          a decided cancel not reported done by then is
                                               taken over by any live worker's timers (its
                                               process died); longer than any provider's own
                                               cancel-confirmation window
GPUHEDGE_SWITCH_INTERVAL_MS        1           the coordination worker's thread switch
                                               interval (``sys.setswitchinterval``; Python's
                                               default is 5 ms): a thread back from a Redis
                                               round trip waits less for the GIL; 0 leaves
                                               the interpreter's value alone
GPUHEDGE_PLUGINS                   ""          comma-separated modules every worker imports
                                               at start (custom policies, validators,
                                               provider adapters register themselves there)
GPUHEDGE_EVENTS_SHOW_REQUEST       0           1: task events and message headers show a
                                               caller's request as Celery would (its repr);
                                               0: only its size (Flower shows
                                               events to whoever reaches it)
GPUHEDGE_RECORDS_MAXLEN            100000      finished races' records kept in the record
                                               stream (``XADD MAXLEN ~``: about this many,
                                               oldest dropped first; docs/records.md); 0:
                                               no records
=================================  ==========  ===============================================

Values are mirrored into the Celery configuration as ``gpuhedge_race_<name>``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from ..envvars import env_flag, env_number
from ..errors import ConfigError
from ..plugins import MODULE_RE


def receipt_ttl_s(env: Mapping[str, str]) -> float:
    """``GPUHEDGE_RECEIPT_TTL_S``: also how long Celery keeps a race's result (tasks/app.py)."""
    return _float(env, "GPUHEDGE_RECEIPT_TTL_S", 86400.0)


def _float(env: Mapping[str, str], name: str, default: float, *, minimum: float = 0.0) -> float:
    return env_number(
        env, name, default, cast=float, kind="a number", valid=lambda v: v > minimum,
        bound=f"a number > {minimum:g}",
    )  # fmt: skip


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    return env_number(
        env, name, default, cast=int, kind="a whole number", valid=lambda v: 1 <= v <= 1024,
        bound="a number from 1 to 1024",
    )  # fmt: skip


def _maxlen(env: Mapping[str, str], name: str, default: int) -> int:
    return env_number(
        env, name, default, cast=int, kind="a whole number (0: off)", valid=lambda v: v >= 0,
        bound="a whole number >= 0 (0: off)",
    )  # fmt: skip


COORD_LOOPS = ("threads", "batched")


def _coord_loop(env: Mapping[str, str]) -> str:
    value = (env.get("GPUHEDGE_COORD_LOOP") or "batched").strip().lower()
    if value not in COORD_LOOPS:
        raise ConfigError(
            f"expected one of {', '.join(COORD_LOOPS)}, got {value!r}", key="GPUHEDGE_COORD_LOOP"
        )
    return value


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
    submit_primary_inline: bool = True
    launch_inline: bool = True
    launch_backstop_s: float = 60.0
    timer_threads: int = 16
    timer_ahead_ms: int = 25
    coord_loop: str = "batched"
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

        load(self.plugins, key="GPUHEDGE_PLUGINS")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RaceSettings:
        """Read and validate the variables of the table above."""
        env = os.environ if environ is None else environ
        namespace = (env.get("GPUHEDGE_TIMER_NAMESPACE") or "races").strip()
        if not re.match(r"^[A-Za-z0-9_.\-]{1,100}$", namespace):
            raise ConfigError(
                f"expected letters, digits, '_', '-' or '.', got {namespace!r}",
                key="GPUHEDGE_TIMER_NAMESPACE",
            )
        plugins = tuple(
            p.strip() for p in (env.get("GPUHEDGE_PLUGINS") or "").split(",") if p.strip()
        )
        for module in plugins:
            if not MODULE_RE.match(module):
                raise ConfigError(f"expected a module path, got {module!r}", key="GPUHEDGE_PLUGINS")
        return cls(
            receipt_ttl_s=receipt_ttl_s(env),
            payload_inline_max=int(
                _float(env, "GPUHEDGE_PAYLOAD_INLINE_MAX", 1_000_000, minimum=-1)
            ),
            payload_by_ref=env_flag(env, "GPUHEDGE_PAYLOAD_BY_REF", True),
            request_max_bytes=int(_float(env, "GPUHEDGE_REQUEST_MAX_BYTES", 1_048_576)),
            watch_interval_s=_float(env, "GPUHEDGE_WATCH_INTERVAL_S", 1.0),
            events=env_flag(env, "GPUHEDGE_RACE_EVENTS", True),
            event_linger_ms=_float(env, "GPUHEDGE_EVENT_LINGER_MS", 100.0, minimum=-1),
            ack_linger_ms=_float(env, "GPUHEDGE_ACK_LINGER_MS", 250.0, minimum=-1),
            timer_namespace=namespace,
            submit_primary_inline=env_flag(env, "GPUHEDGE_SUBMIT_PRIMARY_INLINE", True),
            launch_inline=env_flag(env, "GPUHEDGE_LAUNCH_INLINE", True),
            launch_backstop_s=_float(env, "GPUHEDGE_LAUNCH_BACKSTOP_S", 60.0),
            timer_threads=_count(env, "GPUHEDGE_TIMER_THREADS", 16),
            timer_ahead_ms=int(_float(env, "GPUHEDGE_TIMER_AHEAD_MS", 25.0, minimum=-1)),
            coord_loop=_coord_loop(env),
            cancel_threads=_count(env, "GPUHEDGE_CANCEL_THREADS", 32),
            cancel_backstop_s=_float(env, "GPUHEDGE_CANCEL_BACKSTOP_S", 30.0),
            switch_interval_ms=_float(env, "GPUHEDGE_SWITCH_INTERVAL_MS", 1.0, minimum=-1),
            plugins=plugins,
            records_maxlen=_maxlen(env, "GPUHEDGE_RECORDS_MAXLEN", 100_000),
            events_show_request=env_flag(env, "GPUHEDGE_EVENTS_SHOW_REQUEST", False),
        )
