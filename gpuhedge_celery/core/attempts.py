"""Attempts: one provider job inside a race, with its phase, state timeline and receipt."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ._data import copy_data, enum_by_value, to_enum
from .receipts import CancelReceipt


class Phase(str, enum.Enum):
    """Where an attempt stands in the race (not the provider's JobState)."""

    LAUNCHING = "launching"  # Launch emitted, not yet accepted by the provider
    RUNNING = "running"  # submitted, result pending
    CANCELLING = "cancelling"  # cancel sent, not yet confirmed terminal: still live
    LEAKED = "leaked"  # cancel failed: still live, may still return a result
    ENDED = "ended"  # result in (valid or not), or never submitted
    CANCELLED = "cancelled"  # cancellation confirmed terminal

    def __str__(self) -> str:
        return self.value


LIVE_PHASES = frozenset({Phase.LAUNCHING, Phase.RUNNING, Phase.CANCELLING, Phase.LEAKED})
UNSETTLED_PHASES = frozenset({Phase.LAUNCHING, Phase.RUNNING, Phase.CANCELLING})


@dataclass
class Attempt:
    """One provider job in a race. Times are seconds since the race's Start."""

    id: str
    provider: str
    role: str
    launched_at: float
    phase: Phase = Phase.LAUNCHING
    submitted_at: float | None = None
    job_id: str = ""
    handle: dict[str, Any] | None = None
    last_state: str | None = None
    result_state: str | None = None
    valid: bool | None = None
    reasons: list[str] = field(default_factory=list)
    result_at: float | None = None
    cancel_reason: str | None = None
    cancel_requested: bool = False
    cancel_sent_at: float | None = None
    timeline: list[list[Any]] = field(default_factory=list)
    receipt: CancelReceipt | None = None
    unsent: bool = False  # ended before anything reached its provider (e.g. the budget refused it)

    @property
    def live(self) -> bool:
        return self.phase in LIVE_PHASES

    @property
    def sent(self) -> bool:
        """Whether the attempt's job reached its provider or may have: anything but an attempt
        known never sent. One still launching counts (its submit may be under way)."""
        return not self.unsent

    def to_dict(self) -> dict[str, Any]:
        # Field by field (the same dict dataclasses.asdict gave, at a fraction of its cost): this
        # runs for every attempt on every race step. Containers are copied, never shared.
        receipt = self.receipt
        handle = self.handle
        return {
            "id": self.id,
            "provider": self.provider,
            "role": self.role,
            "launched_at": self.launched_at,
            "phase": self.phase.value,
            "submitted_at": self.submitted_at,
            "job_id": self.job_id,
            "handle": copy_data(handle) if handle is not None else None,
            "last_state": self.last_state,
            "result_state": self.result_state,
            "valid": self.valid,
            "reasons": copy_data(self.reasons),
            "result_at": self.result_at,
            "cancel_reason": self.cancel_reason,
            "cancel_requested": self.cancel_requested,
            "cancel_sent_at": self.cancel_sent_at,
            "timeline": copy_data(self.timeline),
            "receipt": receipt.to_dict() if receipt else None,
            "unsent": self.unsent,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attempt:
        data = dict(data)
        data["phase"] = to_enum(Phase, _PHASES, data["phase"])
        receipt = data.get("receipt")
        data["receipt"] = CancelReceipt.from_dict(receipt) if receipt else None
        return cls(**data)


_PHASES = enum_by_value(Phase)


def hedged(attempts: Iterable[Attempt]) -> bool:
    """THE definition of a hedged race: a second attempt (hedge or fallback) was sent to its
    provider. One the budget refused, or that ended before its submit, does not count."""
    return any(a.role != "primary" and a.sent for a in attempts)


def escalated(attempts: Iterable[Attempt]) -> bool:
    """Whether a fallback attempt was sent to its provider (the same rule as :func:`hedged`)."""
    return any(a.role == "fallback" and a.sent for a in attempts)
