"""Plain-data job types shared by providers, policies and races.

A :class:`JobHandle` is JSON-serialisable so a different process (another Celery worker, the
janitor) can poll or cancel the same provider job.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from ._data import copy_data


class JobState(str, enum.Enum):
    """Lifecycle of one provider job. Providers that cannot tell queued from running say so."""

    QUEUED = "QUEUED"
    IN_PROGRESS = "IN_PROGRESS"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    UNKNOWN = "UNKNOWN"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES

    def __str__(self) -> str:  # so f-strings and JSON show "QUEUED", not "JobState.QUEUED"
        return self.value


TERMINAL_STATES = frozenset(
    {JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT}
)


@dataclass(frozen=True)
class JobHandle:
    """Identifies a submitted job: provider name, the provider's job id, submit time (epoch s)."""

    provider: str
    job_id: str
    submitted_at: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        # Field by field: what dataclasses.asdict gave (``extra`` deep-copied), much cheaper.
        return {
            "provider": self.provider,
            "job_id": self.job_id,
            "submitted_at": self.submitted_at,
            "extra": copy_data(self.extra),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobHandle:
        return cls(
            provider=str(data["provider"]),
            job_id=str(data["job_id"]),
            submitted_at=float(data["submitted_at"]),
            extra=dict(data.get("extra") or {}),
        )

    @classmethod
    def from_json(cls, text: str) -> JobHandle:
        return cls.from_dict(json.loads(text))


@dataclass
class LifecycleEvent:
    """One observed moment of a job: ``t_ms`` after submit, a stage name and free detail."""

    t_ms: float
    stage: str
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"t_ms": self.t_ms, "stage": self.stage, "detail": self.detail}


@dataclass
class AttemptResult:
    """What a provider returned for one job, right-censored to TIMEOUT at the caller's cap."""

    provider: str
    job_id: str
    state: JobState
    wall_ms: float
    payload: Any = None
    metrics: dict[str, Any] = field(default_factory=dict)
    events: list[LifecycleEvent] = field(default_factory=list)
    error: str | None = None

    def to_dict(self, *, include_payload: bool = True) -> dict[str, Any]:
        data = {
            "provider": self.provider,
            "job_id": self.job_id,
            "state": self.state.value,
            "wall_ms": self.wall_ms,
            "metrics": dict(self.metrics),
            "events": [e.to_dict() for e in self.events],
            "error": self.error,
        }
        if include_payload:
            data["payload"] = self.payload
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttemptResult:
        return cls(
            provider=data["provider"],
            job_id=data["job_id"],
            state=JobState(data["state"]),
            wall_ms=float(data["wall_ms"]),
            payload=data.get("payload"),
            metrics=dict(data.get("metrics") or {}),
            events=[LifecycleEvent(**e) for e in data.get("events") or []],
            error=data.get("error"),
        )
