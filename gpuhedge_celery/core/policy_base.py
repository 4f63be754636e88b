"""The policy interface: what a hedging policy is, the control it acts through, and the registry.

A policy is a small deterministic state machine. It never sleeps and never reads a clock: the
race engine (:mod:`gpuhedge_celery.core.race`) calls its hooks when something happens and the
policy answers through a :class:`RaceControl` (launch, poll, cancel, set a timer). Rules every
policy gets from the engine for free: first valid result wins, at most two live jobs, losers
cancelled with receipts. Per-race policy state lives in ``ctl.state`` (a JSON-safe dict), so a
policy object holds only its parameters and a race can be serialised and resumed elsewhere.

Custom policies subclass :class:`Policy` and register with :func:`register_policy`; the built-ins
in :mod:`gpuhedge_celery.core.policies` use exactly the same interface.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Protocol

from ..errors import ConfigError
from .jobs import JobState

PRIMARY, HEDGE, FALLBACK = "primary", "hedge", "fallback"


class AttemptView(Protocol):
    """What a policy may read about one attempt."""

    id: str
    provider: str
    role: str

    @property
    def live(self) -> bool: ...


class RaceControl(Protocol):
    """The race as a policy sees it: read the attempts, ask for actions, keep per-race state."""

    state: dict[str, Any]

    @property
    def has_winner(self) -> bool: ...

    @property
    def live_count(self) -> int: ...

    def elapsed(self) -> float:
        """Seconds since the primary's submit (the race start until it is submitted)."""

    def attempt_for(self, role: str) -> AttemptView | None:
        """The first attempt launched in ``role``, or None."""

    def launch(self, provider: str, role: str) -> str | None:
        """Launch a job; returns its attempt id, or None when it waits for a free live slot."""

    def poll(self, attempt_id: str) -> None:
        """Ask the driver to poll the attempt's status once (answered by ``on_status``)."""

    def cancel(self, attempt_id: str, reason: str) -> None:
        """Cancel a live attempt; it stays in the race until its cancel is confirmed."""

    def set_timer(self, key: str, after_s: float) -> None:
        """Call ``on_timer(key)`` ``after_s`` seconds after the primary's submit."""

    def clear_timer(self, key: str) -> None:
        """Forget a timer; a late delivery of it is ignored."""

    def flag(self, name: str) -> None:
        """Record an outcome flag (``cut_over``, ``escalated``, ...)."""


class Policy:
    """Base class of every policy: parameters plus hooks; subclasses override what they need.

    Hooks run inside the race engine, never concurrently, and must be deterministic functions of
    their arguments, ``ctl.state`` and ``ctl.elapsed()``.
    """

    kind: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()

    def providers(self) -> tuple[str, ...]:
        """Providers this policy may launch, primary first."""
        raise NotImplementedError

    @property
    def name(self) -> str:
        """The canonical string form, parseable by :func:`parse_policy`."""
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        """JSON-safe constructor arguments (``type(self)(**params)`` rebuilds the policy)."""
        raise NotImplementedError

    @classmethod
    def parse(cls, body: str) -> Policy:
        """Build the policy from the part of its name after ``kind:``."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "params": self.params()}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.params() == other.params()

    def __hash__(self) -> int:
        return hash(self.name)

    # Hooks -------------------------------------------------------------------------------
    def on_start(self, ctl: RaceControl) -> None:
        """The race began: launch the primary (default: the first provider)."""
        ctl.launch(self.providers()[0], PRIMARY)

    def on_submitted(self, ctl: RaceControl, attempt: AttemptView) -> None:
        """A launched attempt was accepted by its provider."""

    def on_timer(self, ctl: RaceControl, key: str) -> None:
        """A timer set with ``ctl.set_timer`` came due (only while no winner exists)."""

    def on_status(
        self, ctl: RaceControl, attempt: AttemptView, state: JobState | None, error: str | None
    ) -> None:
        """A status poll answered: ``state``, or ``error`` when the poll failed."""

    def on_failed(self, ctl: RaceControl, attempt: AttemptView) -> None:
        """An attempt ended without a valid result (invalid, failed, timed out, not submitted)."""

    def on_idle(self, ctl: RaceControl) -> None:
        """Every attempt has ended without a valid result; launch nothing and the race fails."""


_REGISTRY: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls.kind`` (and its aliases) parseable and resumable."""
    if not cls.kind or not re.fullmatch(r"[a-z][a-z0-9_]*", cls.kind):
        raise ValueError(f"policy kind must be a lowercase identifier, got {cls.kind!r}")
    for key in (cls.kind, *cls.aliases):
        if key in _REGISTRY and _REGISTRY[key] is not cls:
            raise ValueError(f"policy kind {key!r} is already registered")
        _REGISTRY[key] = cls
    return cls


def registered_policies() -> dict[str, type[Policy]]:
    """Every registered kind (aliases included) and its class."""
    return dict(_REGISTRY)


# --------------------------------------------------------------------------- name helpers

PROVIDER_RE = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
DURATION_RE = r"(\d+(?:\.\d+)?)(ms|s)"


def duration_ms(number: str, unit: str) -> int:
    """A duration matched by ``DURATION_RE`` (number and ``s``/``ms`` unit) in milliseconds."""
    value = float(number) * (1 if unit == "ms" else 1000)
    return int(round(value))


def fmt_s(ms: int | float) -> str:
    """Milliseconds as the shortest seconds string used in policy names (2500 -> ``2.5``)."""
    return f"{ms / 1000:g}"


def bad_name(kind: str, body: str, expected: str) -> ConfigError:
    """The one-line error for a policy name that does not match its kind's grammar."""
    name = f"{kind}:{body}"  # repr: a name holding a newline still makes one line
    return ConfigError(f"bad policy name {name!r}: expected {kind}:{expected}")


def check_ms(value: Any, what: str) -> int:
    """Validate a policy timing parameter (milliseconds, >= 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{what} must be a number of milliseconds >= 0, got {value!r}")
    return int(value)
