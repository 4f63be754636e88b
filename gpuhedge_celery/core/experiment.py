"""Preregistered experiments: the plan file, and the seeded block order its arms run in.

A preregistration fixes, before any request is sent, what is compared and how: the arms (each a
policy, optionally with its providers), how many blocks of how many requests each arm gets,
the seed that shuffles the blocks, the cadence between requests and the one primary metric the
comparison is judged on. ``gpuhedge-celery experiment PREREG.yaml`` runs it; this module is the
pure part: parsing the plan (one-line errors naming the key and the file) and the order.

Blocks, not single requests, are shuffled: traffic and provider load drift over an hour, and a
block of consecutive requests per arm, in a random order of blocks, spreads that drift over the
arms evenly without making any arm wait for all the others.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

ARM_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,100}\Z")
PERCENTILES = ("p50", "p90", "p95", "p99")
#: what a plan may name as its primary metric (columns of ``report``'s rows)
PRIMARY_METRICS = (
    *PERCENTILES,
    "miss_rate",
    "hedge_rate",
    "active_usd_per_request",
    "billed_usd_per_request",
)
TOP_KEYS = (
    "name",
    "seed",
    "arms",
    "blocks_per_arm",
    "block_size",
    "cadence_s",
    "primary_metric",
    "deadline_s",
    "request",
    "timeout_s",
)
ARM_KEYS = ("name", "policy", "providers")
MAX_REQUESTS = 100_000


@dataclass(frozen=True)
class PlanArm:
    """One arm: its name (the records' ``arm``), policy and optional providers (primary first)."""

    name: str
    policy: str
    providers: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Prereg:
    """A parsed preregistration (see ``config/experiments/example.yaml``)."""

    name: str
    seed: int
    arms: tuple[PlanArm, ...]
    blocks_per_arm: int
    block_size: int
    cadence_s: float
    primary_metric: str
    deadline_s: float = 60.0
    request: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float = 300.0
    source: str = "<prereg>"

    @property
    def requests(self) -> int:
        return len(self.arms) * self.blocks_per_arm * self.block_size

    def arm(self, name: str) -> PlanArm:
        return next(a for a in self.arms if a.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seed": self.seed,
            "arms": [
                {
                    "name": a.name,
                    "policy": a.policy,
                    "providers": list(a.providers) if a.providers else None,
                }
                for a in self.arms
            ],
            "blocks_per_arm": self.blocks_per_arm,
            "block_size": self.block_size,
            "cadence_s": self.cadence_s,
            "primary_metric": self.primary_metric,
            "deadline_s": self.deadline_s,
            "timeout_s": self.timeout_s,
        }


@dataclass(frozen=True)
class Slot:
    """One request of the schedule: its index, block number (1-based), arm, and when to send
    it (seconds after the experiment starts)."""

    index: int
    block: int
    arm: str
    at_s: float


def _int(data: Mapping[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise ConfigError("required: a whole number", file=source, key=key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"expected a whole number, got {value!r}", file=source, key=key)
    return value


def _positive_int(data: Mapping[str, Any], key: str, source: str) -> int:
    value = _int(data, key, source)
    if value < 1:
        raise ConfigError(f"expected a whole number >= 1, got {value}", file=source, key=key)
    return value


def _seconds(
    data: Mapping[str, Any], key: str, source: str, default: float, *, positive: bool = False
) -> float:
    value = data.get(key, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        wanted = "seconds > 0" if positive else "seconds >= 0"
        raise ConfigError(f"expected {wanted}, got {value!r}", file=source, key=key)
    return float(value)


def _arm(raw: Any, i: int, source: str) -> PlanArm:
    where = f"arms[{i}]"
    if not isinstance(raw, Mapping):
        raise ConfigError("expected a mapping with name and policy", file=source, key=where)
    for key in raw:
        if key not in ARM_KEYS:
            raise ConfigError(
                f"unknown key (known: {', '.join(ARM_KEYS)})", file=source, key=f"{where}.{key}"
            )
    name, policy = raw.get("name"), raw.get("policy")
    if not isinstance(name, str) or not ARM_RE.match(name):
        raise ConfigError(
            f"expected an arm name of 1-100 letters, digits, '_', '-', '.', ':', got {name!r}",
            file=source,
            key=f"{where}.name",
        )
    if not isinstance(policy, str) or not policy.strip():
        raise ConfigError(
            f"expected a policy name or spec, got {policy!r}", file=source, key=f"{where}.policy"
        )
    providers = raw.get("providers")
    if providers is not None:
        if isinstance(providers, str):
            providers = [p.strip() for p in providers.split(",")]
        if (
            not isinstance(providers, list)
            or not providers
            or not all(isinstance(p, str) and p for p in providers)
        ):
            raise ConfigError(
                f"expected a list of provider names, got {providers!r}",
                file=source,
                key=f"{where}.providers",
            )
        providers = tuple(providers)
    return PlanArm(name, policy.strip(), providers)


def parse_prereg(data: Any, source: str = "<prereg>") -> Prereg:
    """Validate a preregistration mapping; every problem is a one-line ConfigError."""
    if not isinstance(data, Mapping):
        raise ConfigError("expected a mapping at the top level", file=source)
    for key in data:
        if key not in TOP_KEYS:
            raise ConfigError(
                f"unknown key (known: {', '.join(TOP_KEYS)})", file=source, key=str(key)
            )
    raw_arms = data.get("arms")
    if not isinstance(raw_arms, list) or len(raw_arms) < 2:
        raise ConfigError("expected a list of at least two arms", file=source, key="arms")
    arms = tuple(_arm(a, i, source) for i, a in enumerate(raw_arms))
    names = [a.name for a in arms]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ConfigError(f"arm {twice!r} appears twice", file=source, key="arms")
    metric = data.get("primary_metric")
    if metric not in PRIMARY_METRICS:
        raise ConfigError(
            f"expected one of {', '.join(PRIMARY_METRICS)}, got {metric!r}",
            file=source,
            key="primary_metric",
        )
    name = data.get("name", "experiment")
    if not isinstance(name, str) or not ARM_RE.match(name):
        raise ConfigError(
            f"expected a name of letters, digits, '_', '-', '.', ':', got {name!r}",
            file=source,
            key="name",
        )
    request = data.get("request", {})
    if not isinstance(request, Mapping):
        raise ConfigError(
            f"expected a mapping (the request's JSON object), got {request!r}",
            file=source,
            key="request",
        )
    plan = Prereg(
        name=name,
        seed=_int(data, "seed", source),
        arms=arms,
        blocks_per_arm=_positive_int(data, "blocks_per_arm", source),
        block_size=_positive_int(data, "block_size", source),
        cadence_s=_seconds(data, "cadence_s", source, 0.0),
        primary_metric=metric,
        deadline_s=_seconds(data, "deadline_s", source, 60.0, positive=True),
        request=dict(request),
        timeout_s=_seconds(data, "timeout_s", source, 300.0, positive=True),
        source=source,
    )
    if plan.requests > MAX_REQUESTS:
        raise ConfigError(
            f"{plan.requests:,} requests in all, over {MAX_REQUESTS:,}: fewer "
            "blocks or smaller ones",
            file=source,
            key="blocks_per_arm",
        )
    return plan


def block_order(arms: Sequence[str], blocks_per_arm: int, seed: int) -> list[str]:
    """Every arm ``blocks_per_arm`` times, shuffled by ``random.Random(seed)``: the same seed
    gives the same order on every machine and Python version (``Random.shuffle`` of a list)."""
    order = [a for _ in range(blocks_per_arm) for a in arms]
    random.Random(seed).shuffle(order)
    return order


def schedule(plan: Prereg) -> list[Slot]:
    """Every request in order: blocks in the seeded order, ``block_size`` requests each, one
    request every ``cadence_s`` seconds from the start."""
    slots: list[Slot] = []
    order = block_order([a.name for a in plan.arms], plan.blocks_per_arm, plan.seed)
    for block, arm in enumerate(order, 1):
        for _ in range(plan.block_size):
            slots.append(Slot(len(slots), block, arm, len(slots) * plan.cadence_s))
    return slots


def primary_value(row: Mapping[str, Any], metric: str, deadline_s: float) -> float | None:
    """The primary metric from one ``report`` row (seconds, a rate or USD; None: not known)."""
    value: float | None
    if metric in PERCENTILES:
        value = row[f"{metric}_s"]
    elif metric == "miss_rate":
        value = row["miss_rate"][format(deadline_s, "g")]
    else:
        value = row[metric]
    return value
