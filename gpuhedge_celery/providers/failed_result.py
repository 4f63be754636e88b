"""The ``FAILED`` answer of an attempt its provider failed, shared by the adapters that poll a
job API (``http``, ``runpod``): what ``result`` returns instead of raising."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.jobs import AttemptResult, JobHandle, JobState, LifecycleEvent

if TYPE_CHECKING:
    from .base import Provider


def failed_result(
    provider: Provider,
    handle: JobHandle,
    events: list[LifecycleEvent],
    error: str,
    metrics: dict[str, Any] | None = None,
) -> AttemptResult:
    """``FAILED`` at the time elapsed so far, a ``failed`` event after ``events``, no payload;
    ``error`` is kept as given and ``metrics`` copied."""
    ms = provider.elapsed_ms(handle)
    events = [*events, LifecycleEvent(ms, "failed", "provider error")]
    return AttemptResult(
        provider.name, handle.job_id, JobState.FAILED, ms, None, dict(metrics or {}), events, error
    )
