"""Cancellation receipts: what we can prove about a loser we tried to stop.

Receipts are conservative by default: a fresh receipt says ``no_evidence`` and ``leaked=True``;
only observed facts upgrade it. ``terminal_status`` is set only from an observed terminal state,
never from the cancel call's own reply.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from ._data import enum_by_value, to_enum
from .jobs import JobState

#: The words an attempt's reasons carry when its submit may have started a job whose id we never
#: learnt (a lost reply, a worker that died mid-submit): nothing can cancel it, so its receipt
#: stays leaked (see ``Race``'s receipts of attempts that never reported a job).
SUBMIT_OUTCOME_UNKNOWN = "submit outcome unknown"


class Evidence(str, enum.Enum):
    """How strongly we know a cancelled job stopped, strongest first."""

    CONFIRMED_TERMINAL = "confirmed_terminal"  # we polled the job and saw a terminal state
    PROVIDER_ACK = "provider_ack"  # the provider acknowledged the cancel request
    REQUEST_CHANNEL_CLOSED = "request_channel_closed"  # we closed the connection carrying it
    NO_EVIDENCE = "no_evidence"

    @property
    def rank(self) -> int:
        return _EVIDENCE_RANK[self]

    def __str__(self) -> str:
        return self.value


_EVIDENCE_RANK = {
    Evidence.CONFIRMED_TERMINAL: 3,
    Evidence.PROVIDER_ACK: 2,
    Evidence.REQUEST_CHANNEL_CLOSED: 1,
    Evidence.NO_EVIDENCE: 0,
}


class CancelScope(str, enum.Enum):
    """What the cancel stopped: a queued job, one request, a whole container, or unknown."""

    QUEUED_JOB = "queued_job"
    REQUEST = "request"
    CONTAINER = "container"
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value


@dataclass
class CancelReceipt:
    """The audited record of one cancellation. Times are epoch milliseconds."""

    provider: str
    job_id: str
    was_running: bool | None = None
    cancel_sent_ms: float | None = None
    cancel_ack_ms: float | None = None
    terminal_ms: float | None = None
    terminal_status: JobState | None = None
    execution_ms_before_cancel: float | None = None
    estimated_cost_usd: float | None = None
    reconciled_cost_usd: float | None = None
    evidence: Evidence = Evidence.NO_EVIDENCE
    scope: CancelScope = CancelScope.UNKNOWN
    confirmed_terminal: bool = False
    billing_stop_confirmed: bool = False
    leaked: bool = True
    note: str = ""
    #: how long the cancel waited for the fleet's rate-limit token before it was sent (ms)
    token_wait_ms: float | None = None

    def upgrade(self, evidence: Evidence) -> None:
        """Raise the evidence level; never lowers it."""
        if evidence.rank > self.evidence.rank:
            self.evidence = evidence

    def confirm_terminal(self, state: JobState, at_ms: float) -> None:
        """Record an observed terminal state: the strongest evidence, and not leaked."""
        if not state.terminal:
            raise ValueError(f"{state} is not a terminal state")
        self.terminal_status = state
        self.terminal_ms = at_ms
        self.confirmed_terminal = True
        self.upgrade(Evidence.CONFIRMED_TERMINAL)
        self.leaked = False

    def to_dict(self) -> dict[str, Any]:
        # Field by field: the dict dataclasses.asdict gave (enums as their values), much cheaper.
        status = self.terminal_status
        return {
            "provider": self.provider,
            "job_id": self.job_id,
            "was_running": self.was_running,
            "cancel_sent_ms": self.cancel_sent_ms,
            "cancel_ack_ms": self.cancel_ack_ms,
            "terminal_ms": self.terminal_ms,
            "terminal_status": status.value if status else None,
            "execution_ms_before_cancel": self.execution_ms_before_cancel,
            "estimated_cost_usd": self.estimated_cost_usd,
            "reconciled_cost_usd": self.reconciled_cost_usd,
            "evidence": self.evidence.value,
            "scope": self.scope.value,
            "confirmed_terminal": self.confirmed_terminal,
            "billing_stop_confirmed": self.billing_stop_confirmed,
            "leaked": self.leaked,
            "note": self.note,
            **({} if self.token_wait_ms is None else {"token_wait_ms": self.token_wait_ms}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CancelReceipt:
        data = {k: v for k, v in data.items() if k in _RECEIPT_FIELDS}  # a newer writer's extras
        status = data.get("terminal_status")
        data["terminal_status"] = to_enum(JobState, _JOB_STATES, status) if status else None
        data["evidence"] = to_enum(Evidence, _EVIDENCES, data.get("evidence", _NO_EVIDENCE))
        data["scope"] = to_enum(CancelScope, _SCOPES, data.get("scope", _UNKNOWN_SCOPE))
        return cls(**data)


_RECEIPT_FIELDS = frozenset(f.name for f in dataclasses.fields(CancelReceipt))
_JOB_STATES = enum_by_value(JobState)
_EVIDENCES = enum_by_value(Evidence)
_SCOPES = enum_by_value(CancelScope)
_NO_EVIDENCE = Evidence.NO_EVIDENCE.value
_UNKNOWN_SCOPE = CancelScope.UNKNOWN.value
