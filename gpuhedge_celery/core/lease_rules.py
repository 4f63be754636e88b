"""Pure lease rules and data: lease types, how to read a lease row, how long a TTL should be.

No I/O here: the store passes in what it read, the CLI prints what comes out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ._data import copy_data

FREE = "free"
HELD = "held"
STALE = "stale"

# Why a GPU is out of the pool (it takes no new lease; a job it runs finishes). ``drain`` and
# ``fault`` stay until an operator undrains the GPU; the others are cleared by the GPU's worker.
OUT_DRAIN = "drain"  # an operator drained it (gpuhedge-celery gpus drain)
OUT_FAULT = "fault"  # ECC or Xid errors: drained by its worker's health check
OUT_HEALTH = "health"  # another process holds its memory
OUT_RUNNER = "runner"  # its model is not loaded, or its model server is not ready
OUT_REASONS = (OUT_DRAIN, OUT_FAULT, OUT_HEALTH, OUT_RUNNER)
STICKY_REASONS = (OUT_DRAIN, OUT_FAULT)  # cleared by undrain only

IN_POOL = "in pool"
DRAINING = "draining"  # drained (or faulted) while a job still runs there
DRAINED = "drained"  # drained and idle: safe for maintenance
OUT = "out"

# Used only until a pool's TTL is set (``gpuhedge-celery leases suggest-ttl`` says what to set).
DEFAULT_POOL_TTL_MS = 60_000

DEFAULT_PERCENTILE = 99.0
DEFAULT_MARGIN = 1.5
MIN_TTL_MS = 1_000
FEW_SAMPLES = 20


def classify(*, leased: bool, host_live: bool, token: int = 0, accepted: int = 0) -> str:
    """The state the table shows for one GPU: ``free``, ``held`` or ``stale``.

    A lease is stale when its host stopped heartbeating (nobody renews it, it only waits for its
    TTL) or when the GPU's worker already accepted a newer token than the lease carries.
    """
    if not leased:
        return FREE
    if not host_live or token < accepted:
        return STALE
    return HELD


def out_value(detail: str, since_ms: int) -> str:
    """How an out-of-pool reason is stored: ``since_ms|detail``."""
    return f"{int(since_ms)}|{detail}"


def parse_out(fields: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The stored reasons (``reason -> since_ms|detail``) as ``reason -> {detail, since_ms}``."""
    found = {}
    for kind, value in sorted(fields.items()):
        since, sep, detail = str(value).partition("|")
        if not sep or not since.isdigit():
            since, detail = "0", str(value)
        found[kind] = {"detail": detail, "since_ms": int(since)}
    return found


def availability(out: dict[str, Any], *, leased: bool) -> str:
    """Whether a GPU takes new leases: ``in pool``, ``draining`` (drained or faulted while a job
    still runs), ``drained`` (and idle), or ``out`` (unhealthy, model not loaded)."""
    if not out:
        return IN_POOL
    if any(kind in out for kind in STICKY_REASONS):
        return DRAINING if leased else DRAINED
    return OUT


def validate_ttl_ms(ttl_ms: object, *, what: str = "ttl_ms") -> int:
    """``ttl_ms`` as a positive int; ValueError naming ``what`` otherwise."""
    if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int):
        raise ValueError(f"{what} must be a whole number of milliseconds, got {ttl_ms!r}")
    if ttl_ms <= 0:
        raise ValueError(f"{what} must be > 0 ms, got {ttl_ms}")
    return ttl_ms


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile of ``values`` (sorted or not), ``0 < pct <= 100``."""
    if not values:
        raise ValueError("no values")
    if not 0 < pct <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {pct}")
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class TtlSuggestion:
    """A recommended lease TTL and the numbers it came from."""

    ttl_ms: int
    samples: int
    percentile: float  # which percentile was used (100 = the maximum, when samples are few)
    percentile_s: float  # that percentile of the recorded durations
    margin: float
    median_s: float
    max_s: float
    reason: str

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def suggest_ttl(
    durations_s: Iterable[float],
    *,
    pct: float = DEFAULT_PERCENTILE,
    margin: float = DEFAULT_MARGIN,
    min_ttl_ms: int = MIN_TTL_MS,
) -> TtlSuggestion:
    """Recommend a lease TTL from recorded job durations (seconds).

    TTL = the ``pct`` percentile of durations x ``margin`` (at least ``min_ttl_ms``): nearly every
    job then finishes within one TTL even if its renewals stall, while a crashed holder's GPU
    comes back within that TTL. With fewer than 20 samples the maximum stands in for the
    percentile, because a percentile of a handful of numbers is noise.
    """
    values = [float(d) for d in durations_s]
    if not values:
        raise ValueError("no job durations recorded: nothing to base a TTL on")
    bad = [d for d in values if not math.isfinite(d) or d < 0]
    if bad:
        raise ValueError(f"job durations must be finite and >= 0 s, got {bad[0]!r}")
    if margin < 1:
        raise ValueError(f"margin must be >= 1, got {margin}")
    used_pct = 100.0 if len(values) < FEW_SAMPLES else pct
    p = percentile(values, used_pct)
    ttl_ms = max(min_ttl_ms, math.ceil(p * margin * 1000))
    which = "max" if used_pct == 100.0 else f"p{used_pct:g}"
    few = f" (only {len(values)} samples, so the max)" if used_pct == 100.0 else ""
    reason = (
        f"{which} of {len(values)} recorded job durations is {p:.3f} s{few}; "
        f"TTL = {which} x {margin:g} margin = {ttl_ms / 1000:.3f} s"
        + (f" (raised to the {min_ttl_ms} ms floor)" if ttl_ms == min_ttl_ms else "")
        + ": jobs that long still finish inside one TTL if renewal stalls, and a crashed "
        "holder's GPU is free again within it"
    )
    return TtlSuggestion(
        ttl_ms=ttl_ms,
        samples=len(values),
        percentile=used_pct,
        percentile_s=p,
        margin=margin,
        median_s=percentile(values, 50),
        max_s=max(values),
        reason=reason,
    )


@dataclass(frozen=True)
class GpuInfo:
    """A registered GPU: its id, pool, owning host and the labels a router may match on."""

    gpu_id: str
    pool: str
    host: str
    labels: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        # Field by field: what dataclasses.asdict gave (labels copied), much cheaper.
        return {
            "gpu_id": self.gpu_id,
            "pool": self.pool,
            "host": self.host,
            "labels": copy_data(self.labels),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GpuInfo:
        return cls(data["gpu_id"], data["pool"], data["host"], dict(data.get("labels") or {}))


@dataclass(frozen=True)
class Lease:
    """A held GPU lease; travels inside Celery messages via ``to_dict``/``from_dict``."""

    gpu_id: str
    pool: str
    token: int
    holder: str
    ttl_ms: int
    since_ms: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_id": self.gpu_id,
            "pool": self.pool,
            "token": self.token,
            "holder": self.holder,
            "ttl_ms": self.ttl_ms,
            "since_ms": self.since_ms,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lease:
        return cls(
            gpu_id=str(data["gpu_id"]),
            pool=str(data["pool"]),
            token=int(data["token"]),
            holder=str(data["holder"]),
            ttl_ms=int(data["ttl_ms"]),
            since_ms=int(data.get("since_ms") or 0),
        )


@dataclass(frozen=True)
class LeaseRow:
    """One line of the lease table (CLI and reconcile)."""

    gpu_id: str
    pool: str
    host: str
    host_live: bool
    state: str  # free / held / stale (core.lease_rules.classify)
    holder: str | None
    token: int | None
    ttl_left_ms: int | None
    since_ms: int | None
    accepted_token: int
    labels: dict[str, str] = field(default_factory=dict)
    out: dict[str, dict[str, Any]] = field(default_factory=dict)  # reason -> detail, since_ms
    health: dict[str, Any] | None = None  # the worker's last health sample (None: none recent)

    @property
    def availability(self) -> str:
        """``in pool``, ``draining``, ``drained`` or ``out`` (see :func:`availability`)."""
        return availability(self.out, leased=self.token is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu_id": self.gpu_id,
            "pool": self.pool,
            "host": self.host,
            "host_live": self.host_live,
            "state": self.state,
            "holder": self.holder,
            "token": self.token,
            "ttl_left_ms": self.ttl_left_ms,
            "since_ms": self.since_ms,
            "accepted_token": self.accepted_token,
            "labels": copy_data(self.labels),
            "availability": self.availability,
            "out": copy_data(self.out),
            "health": copy_data(self.health),
        }


def parse_lease_value(value: str) -> tuple[int, int, str]:
    """Split a lease value ``token|since_ms|holder`` (the holder may itself contain ``|``)."""
    token, since, holder = value.split("|", 2)
    return int(token), int(since), holder


@dataclass(frozen=True)
class FenceMark:
    """A GPU worker's own high-water mark: the highest token it accepted, for which delivery and
    which holder.

    It backs up the ``accepted`` key in Redis, which a failover may lose: a token below the mark,
    or equal to it for another delivery (a failover can issue a number again), is refused, while
    the same delivery repeating its check after a lost reply is not.
    """

    token: int = 0
    delivery: str = ""
    holder: str = ""  # '' when the accepting caller did not say

    def refuses(self, token: int, delivery: str) -> bool:
        """Whether work carrying ``token`` for ``delivery`` must not run under this mark."""
        return token < self.token or (token == self.token and delivery != self.delivery)

    def frees(self, token: int, holder: str) -> bool:
        """Whether the lease of refused work carrying ``token`` for ``holder`` may be freed: no
        work this mark accepted runs under it. Equal to the mark, only another holder's lease
        (a number issued again) is; the same holder's is a duplicate delivery of the job
        running under it, and an unknown holder tells nothing."""
        if token < self.token:
            return True
        return token == self.token and bool(holder) and bool(self.holder) and holder != self.holder

    def after(self, token: int, delivery: str, holder: str = "") -> FenceMark:
        """The mark once ``token`` was accepted for ``delivery`` (it never goes down)."""
        return FenceMark(token, delivery, holder) if token > self.token else self
