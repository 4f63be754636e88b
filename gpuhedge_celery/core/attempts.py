"""Attempts: one provider job inside a race, with its phase, state timeline and receipt."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

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

    @property
    def live(self) -> bool:
        return self.phase in LIVE_PHASES

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["phase"] = self.phase.value
        data["receipt"] = self.receipt.to_dict() if self.receipt else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attempt:
        data = dict(data)
        data["phase"] = Phase(data["phase"])
        data["receipt"] = CancelReceipt.from_dict(data["receipt"]) if data.get("receipt") else None
        return cls(**data)
