"""Parsing ``GPUHEDGE_*`` environment variables: the one place, with ``settings.py``, that
reads them (``tests/test_settings_reads.py`` holds the package to that).

The ``*_values`` functions parse each section's variables from a mapping into the keyword
arguments of that section's class; the section's ``from_env`` builds it and checks what needs
the section's own knowledge (a runner spec, a plugin path, a webhook URL). This module is a leaf:
it imports nothing of the package but its errors, URL parsing and names, so every section can
build on it.
``env_number`` / ``env_flag`` each say what they expect, so a bad value's :class:`ConfigError`
reads ``expected <what>, got '<value>'`` with the variable as its key. The variables are
listed, once, in docs/configuration.md (*Environment variables*).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .errors import ConfigError
from .names import pool_name_problem
from .redis_url import is_cluster, with_sentinel_options

N = TypeVar("N", int, float)
D = TypeVar("D")


def env_number(
    env: Mapping[str, str],
    name: str,
    default: D,
    *,
    cast: Callable[[str], N],
    kind: str,
    valid: Callable[[N], bool],
    bound: str,
) -> N | D:
    """``name``'s value (stripped) as ``cast`` makes it, or ``default`` when unset or blank.

    A value ``cast`` rejects fails with ``expected <kind>``, one that is not ``valid`` with
    ``expected <bound>``.
    """
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = cast(raw)
    except ValueError:
        raise ConfigError(f"expected {kind}, got {raw!r}", key=name) from None
    if not valid(value):
        raise ConfigError(f"expected {bound}, got {raw!r}", key=name)
    return value


def env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """``name``'s on/off value (1/0, true/false, yes/no, on/off), or ``default`` when unset or
    blank; anything else is a one-line ConfigError naming the variable."""
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"expected 1/0, true/false, yes/no or on/off, got {raw!r}", key=name)


def _float(
    env: Mapping[str, str], name: str, default: D, *, minimum: float = 0.0, bound: str = ""
) -> float | D:
    """A number above ``minimum``; ``bound`` says so in its error (default ``a number > M``)."""
    return env_number(
        env,
        name,
        default,
        cast=float,
        kind="a number",
        valid=lambda v: v > minimum,
        bound=bound or f"a number > {minimum:g}",
    )


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    return env_number(
        env,
        name,
        default,
        cast=int,
        kind="a whole number",
        valid=lambda v: 1 <= v <= 1024,
        bound="a number from 1 to 1024",
    )


def _maxlen(env: Mapping[str, str], name: str, default: int) -> int:
    return env_number(
        env,
        name,
        default,
        cast=int,
        kind="a whole number (0: off)",
        valid=lambda v: v >= 0,
        bound="a whole number >= 0 (0: off)",
    )


def _positive(env: Mapping[str, str], name: str, default: D) -> float | D:
    return _float(env, name, default, bound="a positive number")


TIMER_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,100}\Z")


def receipt_ttl_s(env: Mapping[str, str]) -> float:
    """``GPUHEDGE_RECEIPT_TTL_S``: also how long Celery keeps a race's result (tasks/app.py)."""
    return _float(env, "GPUHEDGE_RECEIPT_TTL_S", 86400.0)


PLUGINS_VAR = "GPUHEDGE_PLUGINS"
RACE_SHARDS_VAR = "GPUHEDGE_RACE_SHARDS"
MAX_RACE_SHARDS = 64  # store/race_keys.py MAX_SHARDS (this module imports none of the package)
# a Redis Cluster's default: one per primary of the smallest cluster; each shard's timers cost
# claims of their own, so more shards than primaries cost Redis CPU (docs/operations.md)
CLUSTER_RACE_SHARDS = 3


def race_shards(env: Mapping[str, str]) -> int:
    """``GPUHEDGE_RACE_SHARDS``: how many shards races and their timers are spread over; by
    default 1, or ``CLUSTER_RACE_SHARDS`` when ``GPUHEDGE_REDIS_URL`` names a Redis Cluster."""
    url = env.get(REDIS_URL_VAR) or DEFAULT_REDIS_URL
    return env_number(
        env,
        RACE_SHARDS_VAR,
        CLUSTER_RACE_SHARDS if is_cluster(url) else 1,
        cast=int,
        kind="a whole number",
        valid=lambda v: 1 <= v <= MAX_RACE_SHARDS,
        bound=f"a whole number from 1 to {MAX_RACE_SHARDS}",
    )


def race_values(env: Mapping[str, str]) -> dict[str, Any]:
    """The race coordinator's section (:class:`~gpuhedge_celery.race.settings.RaceSettings`),
    its plugin module paths not yet checked."""
    namespace = (env.get("GPUHEDGE_TIMER_NAMESPACE") or "races").strip()
    if not TIMER_NAMESPACE_RE.match(namespace):
        raise ConfigError(
            f"expected letters, digits, '_', '-' or '.', got {namespace!r}",
            key="GPUHEDGE_TIMER_NAMESPACE",
        )
    plugins = tuple(p.strip() for p in (env.get(PLUGINS_VAR) or "").split(",") if p.strip())
    return dict(
        receipt_ttl_s=receipt_ttl_s(env),
        payload_inline_max=int(_float(env, "GPUHEDGE_PAYLOAD_INLINE_MAX", 1_000_000, minimum=-1)),
        payload_by_ref=env_flag(env, "GPUHEDGE_PAYLOAD_BY_REF", True),
        request_max_bytes=int(_float(env, "GPUHEDGE_REQUEST_MAX_BYTES", 1_048_576)),
        watch_interval_s=_float(env, "GPUHEDGE_WATCH_INTERVAL_S", 1.0),
        events=env_flag(env, "GPUHEDGE_RACE_EVENTS", True),
        event_linger_ms=_float(env, "GPUHEDGE_EVENT_LINGER_MS", 100.0, minimum=-1),
        ack_linger_ms=_float(env, "GPUHEDGE_ACK_LINGER_MS", 250.0, minimum=-1),
        timer_namespace=namespace,
        race_shards=race_shards(env),
        launch_backstop_s=_float(env, "GPUHEDGE_LAUNCH_BACKSTOP_S", 60.0),
        timer_threads=_count(env, "GPUHEDGE_TIMER_THREADS", 16),
        timer_ahead_ms=int(_float(env, "GPUHEDGE_TIMER_AHEAD_MS", 25.0, minimum=-1)),
        cancel_threads=_count(env, "GPUHEDGE_CANCEL_THREADS", 32),
        cancel_backstop_s=_float(env, "GPUHEDGE_CANCEL_BACKSTOP_S", 30.0),
        switch_interval_ms=_float(env, "GPUHEDGE_SWITCH_INTERVAL_MS", 1.0, minimum=-1),
        plugins=plugins,
        records_maxlen=_maxlen(env, "GPUHEDGE_RECORDS_MAXLEN", 100_000),
        events_show_request=env_flag(env, "GPUHEDGE_EVENTS_SHOW_REQUEST", False),
    )


WEBHOOK_URL_VAR, WEBHOOK_SECRET_VAR = "GPUHEDGE_WEBHOOK_URL", "GPUHEDGE_WEBHOOK_SECRET"
WEBHOOK_PREVIOUS_VAR = "GPUHEDGE_WEBHOOK_SECRET_PREVIOUS"


def webhook_values(env: Mapping[str, str]) -> dict[str, Any]:
    """The webhook section (:class:`~gpuhedge_celery.webhooks.settings.WebhookSettings`), its
    URL and secrets not yet checked against each other."""
    url = (env.get(WEBHOOK_URL_VAR) or "").strip().rstrip("/")
    secret = env.get(WEBHOOK_SECRET_VAR) or ""
    previous = env.get(WEBHOOK_PREVIOUS_VAR) or ""
    return dict(
        url=url,
        secret=secret,
        fallback_s=_positive(env, "GPUHEDGE_WEBHOOK_FALLBACK_S", 30.0),
        max_bytes=int(_positive(env, "GPUHEDGE_WEBHOOK_MAX_BYTES", 4 * 1024 * 1024)),
        previous_secret=previous,
    )


def janitor_values(env: Mapping[str, str]) -> dict[str, Any]:
    """The janitor's section (:class:`~gpuhedge_celery.settings.JanitorSettings`); a variable
    left unset leaves the class's default."""
    values: dict[str, Any] = {}
    for name, attr, cast in (
        ("GPUHEDGE_JANITOR_STALE_S", "stale_s", float),
        ("GPUHEDGE_JANITOR_LIMIT", "limit", int),
    ):
        value = env_number(
            env,
            name,
            None,
            cast=cast,
            kind="a positive number",
            valid=lambda v: v > 0,
            bound="a positive number",
        )
        if value is not None:
            values[attr] = value
    return values


METRICS_PORT_VAR, METRICS_ADDR_VAR = "GPUHEDGE_METRICS_PORT", "GPUHEDGE_METRICS_ADDR"
METRICS_OFF = ("0", "false", "no", "off")


def metrics_enabled(env: Mapping[str, str]) -> bool:
    """Whether ``GPUHEDGE_METRICS`` leaves metrics on (the default)."""
    return (env.get("GPUHEDGE_METRICS") or "1").strip().lower() not in METRICS_OFF


def parse_port(raw: str | None, key: str) -> int | None:
    """A TCP port (None when unset or blank); ConfigError naming ``key`` if bad."""
    if raw is None or not raw.strip():
        return None
    try:
        port = int(raw)
    except ValueError:
        raise ConfigError(f"expected a TCP port number, got {raw!r}", key=key) from None
    if not 0 < port < 65536:
        raise ConfigError(f"expected a TCP port number 1-65535, got {raw!r}", key=key)
    return port


def metrics_port(env: Mapping[str, str]) -> int | None:
    """``GPUHEDGE_METRICS_PORT``: a worker's ``/metrics`` port, None when unset (none)."""
    return parse_port(env.get(METRICS_PORT_VAR), METRICS_PORT_VAR)


def metrics_addr(env: Mapping[str, str], default: str) -> str:
    """``GPUHEDGE_METRICS_ADDR``: the address a worker's ``/metrics`` binds."""
    return (env.get(METRICS_ADDR_VAR) or default).strip()


METRICS_ADDR_DEFAULT = "127.0.0.1"


def metrics_values(env: Mapping[str, str]) -> dict[str, Any]:
    """A worker's endpoint (:class:`~gpuhedge_celery.settings.MetricsSettings`)."""
    return dict(
        enabled=metrics_enabled(env),
        port=metrics_port(env),
        addr=metrics_addr(env, METRICS_ADDR_DEFAULT),
    )


RUNNER_ENV_VAR = "GPUHEDGE_RUNNER_ENV"


def runner_env_names(env: Mapping[str, str]) -> frozenset[str]:
    """``GPUHEDGE_RUNNER_ENV``: more names a model command inherits (run_context.py)."""
    names = (env.get(RUNNER_ENV_VAR) or "").split(",")
    return frozenset(n.strip() for n in names if n.strip())


PROBE_DIR_VAR, PROBE_SITES_VAR = "GPUHEDGE_BENCH_PROBE_DIR", "GPUHEDGE_BENCH_PROBE_SITES"


def probe_dir(env: Mapping[str, str]) -> str | None:
    """``GPUHEDGE_BENCH_PROBE_DIR``: where a bench worker writes its Redis counts (bench only)."""
    return env.get(PROBE_DIR_VAR) or None


def probe_sites(env: Mapping[str, str]) -> bool:
    """``GPUHEDGE_BENCH_PROBE_SITES``: count each Redis round trip by call site (bench only)."""
    return env.get(PROBE_SITES_VAR, "").lower() in ("1", "on", "true", "yes")


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "gpuhedge"
REDIS_URL_VAR, PREFIX_VAR = "GPUHEDGE_REDIS_URL", "GPUHEDGE_PREFIX"
SENTINEL_MASTER_VAR = "GPUHEDGE_REDIS_SENTINEL_MASTER"
SENTINEL_PASSWORD_VAR = "GPUHEDGE_REDIS_SENTINEL_PASSWORD"
WAIT_REPLICAS_VAR, WAIT_TIMEOUT_VAR = (
    "GPUHEDGE_REDIS_WAIT_REPLICAS",
    "GPUHEDGE_REDIS_WAIT_TIMEOUT_MS",
)


def core_values(env: Mapping[str, str], overrides: Mapping[str, str | None]) -> dict[str, Any]:
    """The shared section (:class:`~gpuhedge_celery.shared_settings.Settings`); ``overrides``
    (the CLI's options) win over the environment where not None."""
    values: dict[str, Any] = {
        "redis_url": env.get(REDIS_URL_VAR) or DEFAULT_REDIS_URL,
        "prefix": env.get(PREFIX_VAR) or DEFAULT_PREFIX,
        "config_path": env.get("GPUHEDGE_CONFIG") or None,
        "wait_replicas": int(_number(env, WAIT_REPLICAS_VAR, 0, integer=True, strict=False)),
        "wait_timeout_ms": int(_number(env, WAIT_TIMEOUT_VAR, 1000, integer=True)),
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    # a Sentinel URL carries its master's name and the Sentinels' password from here on, so
    # every client built from the URL alone (store, listener, Celery) finds the same primary
    values["redis_url"] = with_sentinel_options(
        values["redis_url"],
        (env.get(SENTINEL_MASTER_VAR) or "").strip() or None,
        env.get(SENTINEL_PASSWORD_VAR) or None,
    )
    return values


def broker_prefix(env: Mapping[str, str], prefix: str) -> str:
    """The prefix of Celery's own keys (queues, results, remote control): ``GPUHEDGE_BROKER_PREFIX``
    when it is set (to anything, "" included), else ``<GPUHEDGE_PREFIX>:`` for a prefix other
    than the default, so two deployments with their own prefixes never share queues; the
    default prefix keeps Celery's plain layout (what other Celery apps calling our tasks by
    name, and every deployment that never set a prefix, use)."""
    if "GPUHEDGE_BROKER_PREFIX" in env:
        return env["GPUHEDGE_BROKER_PREFIX"]
    return "" if prefix == DEFAULT_PREFIX else f"{prefix}:"


def _number(
    env: Mapping[str, str],
    name: str,
    default: D,
    *,
    minimum: float = 0.0,
    integer: bool = False,
    strict: bool = True,
) -> float | D:
    """``name``'s number, or ``default`` (of any type) when unset, blank or ``none``."""
    raw = env.get(name)
    if raw is None or raw.strip() == "" or raw.strip().lower() == "none":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"expected {kind}, got {raw!r}", key=name) from None
    if value < minimum or (strict and value == minimum):
        sign = ">" if strict else ">="
        raise ConfigError(f"expected a value {sign} {minimum:g}, got {raw!r}", key=name)
    return value


def _optional_int(value: float | None) -> int | None:
    return None if value is None else int(value)


def pool_direct(env: Mapping[str, str]) -> bool:
    """``GPUHEDGE_POOL_DIRECT``: a caller may send a job straight to a free GPU."""
    return env_flag(env, "GPUHEDGE_POOL_DIRECT", True)


GPU_VAR = "GPUHEDGE_GPU"  # makes a worker a GPU worker: a helper starting others drops it


RUNNER_VAR, BROKER_URL_VAR = "GPUHEDGE_RUNNER", "GPUHEDGE_BROKER_URL"
LABELS_VAR, COORD_QUEUES_VAR = "GPUHEDGE_GPU_LABELS", "GPUHEDGE_COORD_QUEUES"


def glue_values(env: Mapping[str, str]) -> dict[str, Any]:
    """The Celery glue's section (:class:`~gpuhedge_celery.tasks.config.GlueConfig`) but its
    shared ``settings``. Left as text for the glue to check: ``gpu`` and ``runner`` (a GPU
    id, a runner spec), ``broker_url`` (its scheme), ``labels`` and ``coord_queues``; ``host``
    and ``beat_schedule`` are "" when unset (the glue's defaults)."""
    gpu = (env.get(GPU_VAR) or "").strip() or None
    runner = (env.get(RUNNER_VAR) or "cpu").strip()
    pool = (env.get("GPUHEDGE_POOL") or "default").strip()
    problem = pool_name_problem(pool)
    if problem is not None:
        raise ConfigError(problem, key="GPUHEDGE_POOL")
    pool_ttl = _number(env, "GPUHEDGE_POOL_TTL_MS", None, integer=True)
    acquire = _number(env, "GPUHEDGE_ACQUIRE_TIMEOUT_S", None)
    broker_url = (env.get(BROKER_URL_VAR) or "").strip() or None
    if broker_url is not None:  # a broker of its own behind Sentinel: the same two variables
        broker_url = with_sentinel_options(
            broker_url,
            (env.get(SENTINEL_MASTER_VAR) or "").strip() or None,
            env.get(SENTINEL_PASSWORD_VAR) or None,
        )
    health = (env.get("GPUHEDGE_HEALTH") or "auto").strip().lower()
    if health not in ("auto", "on", "off"):
        raise ConfigError(f"expected auto, on or off, got {health!r}", key="GPUHEDGE_HEALTH")
    xids = (env.get("GPUHEDGE_XID_IGNORE") or "13,31,43,45").replace(" ", "")
    if not all(x.isdigit() for x in filter(None, xids.split(","))):
        raise ConfigError(
            f"expected Xid numbers like 13,31, got {xids!r}", key="GPUHEDGE_XID_IGNORE"
        )
    server_cmd = (env.get("GPUHEDGE_SERVER_CMD") or "").strip() or None
    if server_cmd is not None:
        try:
            shlex.split(server_cmd)
        except ValueError as e:
            raise ConfigError(f"cannot parse the command: {e}", key="GPUHEDGE_SERVER_CMD") from None
    per_child = _number(env, "GPUHEDGE_MAX_TASKS_PER_CHILD", None, integer=True)
    per_child_mb = _number(env, "GPUHEDGE_MAX_MEMORY_PER_CHILD_MB", None, integer=True)
    return dict(
        broker_url=broker_url,
        visibility_timeout_s=_number(env, "GPUHEDGE_VISIBILITY_TIMEOUT_S", 3600.0),
        restore_interval_s=_number(env, "GPUHEDGE_RESTORE_INTERVAL_S", 10.0),
        reconcile_interval_s=_number(env, "GPUHEDGE_RECONCILE_INTERVAL_S", 30.0),
        reconcile_grace_s=_number(env, "GPUHEDGE_RECONCILE_GRACE_S", 10.0, strict=False),
        control_timeout_s=_number(env, "GPUHEDGE_CONTROL_TIMEOUT_S", 1.0),
        host_ttl_ms=int(_number(env, "GPUHEDGE_HOST_TTL_MS", 15_000, integer=True)),
        coord_concurrency=int(_number(env, "GPUHEDGE_COORD_CONCURRENCY", 32, integer=True)),
        coord_queues=env.get(COORD_QUEUES_VAR),
        acquire_timeout_s=acquire,
        max_attempts=int(_number(env, "GPUHEDGE_MAX_ATTEMPTS", 3, integer=True)),
        pool_direct=pool_direct(env),
        gpu=gpu,
        pool=pool,
        labels=env.get(LABELS_VAR),
        host=(env.get("GPUHEDGE_HOST") or "").strip(),
        runner=runner,
        pool_ttl_ms=_optional_int(pool_ttl),
        beat_schedule=(env.get("GPUHEDGE_BEAT_SCHEDULE") or "").strip(),
        runner_retry_s=_number(env, "GPUHEDGE_RUNNER_RETRY_S", 1.0),
        runner_retry_max_s=_number(env, "GPUHEDGE_RUNNER_RETRY_MAX_S", 60.0),
        runner_wait_s=_number(env, "GPUHEDGE_RUNNER_WAIT_S", 30.0, strict=False),
        server_cmd=server_cmd,
        max_tasks_per_child=_optional_int(per_child),
        max_memory_per_child_mb=_optional_int(per_child_mb),
        health=health,
        health_interval_s=_number(env, "GPUHEDGE_HEALTH_INTERVAL_S", 5.0),
        foreign_memory_mb=_number(env, "GPUHEDGE_FOREIGN_MEMORY_MB", 256.0, strict=False),
        xid_ignore=tuple(sorted({int(x) for x in xids.split(",") if x})),
        nvml_replay=(env.get("GPUHEDGE_NVML_REPLAY") or "").strip() or None,
    )


SIGNING_PATHS = (
    ("key", "GPUHEDGE_SECURITY_KEY"),
    ("certificate", "GPUHEDGE_SECURITY_CERTIFICATE"),
    ("cert_store", "GPUHEDGE_SECURITY_CERT_STORE"),
)


def signing_values(env: Mapping[str, str]) -> dict[str, Any] | None:
    """Celery message signing (:class:`~gpuhedge_celery.tasks.message_signing.Signing`); None
    when it is off (no variable set)."""
    values = {name: (env.get(var) or "").strip() for name, var in SIGNING_PATHS}
    if not any(values.values()):
        return None
    for name, var in SIGNING_PATHS:
        if not values[name]:
            others = ", ".join(v for n, v in SIGNING_PATHS if values[n])
            raise ConfigError(f"message signing needs it too ({others} is set)", key=var)
    for name, var in SIGNING_PATHS[:2]:
        if not os.path.isfile(values[name]):
            raise ConfigError(f"no such file: {values[name]!r}", key=var)
    if not (glob.glob(values["cert_store"]) or os.path.exists(values["cert_store"])):
        raise ConfigError(
            f"no certificate at {values['cert_store']!r}", key="GPUHEDGE_SECURITY_CERT_STORE"
        )
    digest = (env.get("GPUHEDGE_SECURITY_DIGEST") or "sha256").strip()
    return dict(
        key=values["key"],
        certificate=values["certificate"],
        cert_store=values["cert_store"],
        key_password=env.get("GPUHEDGE_SECURITY_KEY_PASSWORD") or None,
        digest=digest,
    )


# Switches of paths a measurement retired: a worker that still finds one set says it is ignored.
RETIRED_VARS = (
    ("GPUHEDGE_COORD_LOOP", "the batched coordination loop is the only one"),
    ("GPUHEDGE_LAUNCH_INLINE", "launches always run on the coordinator's launch threads"),
    ("GPUHEDGE_SUBMIT_PRIMARY_INLINE", "hedged_infer always submits its first attempt itself"),
)


def retired_set(env: Mapping[str, str]) -> list[str]:
    """One line for each retired variable set in ``env``."""
    found = [(name, why) for name, why in RETIRED_VARS if name in env]
    return [f"{name} is set but no longer read: {why}" for name, why in found]
