"""Stopping a race, as its stopper sees it: what a stop would do (or did) to a race, read from
its state in Redis.

The stop itself is an engine event (``StopRequested``) applied by a coordination worker like
any other (``gpuhedge.race_step``; the sending side is :mod:`gpuhedge_celery.tasks.stop`). This
module reads the race before the stop is sent and while the stopper waits for it to be applied,
and says what happened as a :class:`StopAnswer`. It knows nothing about Celery.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import ConfigError

# What a stop found or did (StopAnswer.outcome).
STOPPED = "stopped"  # this stop was applied: the caller is failed, every live job cancelled
ALREADY_STOPPED = "already_stopped"  # an earlier stop was: nothing more to do
ALREADY_FINISHED = "already_finished"  # won, failed or past its deadline: nothing to stop
UNKNOWN = "unknown"  # no such race (never created, not created yet, or expired)
PENDING = "pending"  # sent, but no coordination worker applied it within the wait
REVOKED = "revoked"  # not created yet: its hedged_infer was revoked instead (RaceResult.stop)
STOP_REASON = "stopped"  # the engine's cancel reason for a stopped race's jobs

BY_MAX = 200  # characters of a stopper's name


def check_by(by: Any) -> str:
    """The stopper's name as the receipt keeps it (``cli``, ``revoke`` or a caller's word);
    ConfigError for one that is not a short single line."""
    if not isinstance(by, str) or not by.strip():
        raise ConfigError(
            f"expected a non-empty string naming who stops the race, got {by!r}", key="by"
        )
    if len(by) > BY_MAX or any(ord(c) < 32 for c in by):
        raise ConfigError(
            f"expected one line of at most {BY_MAX} characters, got {by[:40]!r}...", key="by"
        )
    return by.strip()


@dataclass
class StopAnswer:
    """What a stop found or did. ``ok``: the race is stopped (by this stop or an earlier one),
    or was revoked before it started."""

    race_id: str
    outcome: str
    stopped_by: str | None = None
    stopped_at: float | None = None  # epoch s, the race's clock (Redis's)
    winner: str | None = None  # the provider that won, for a race that finished first
    note: str = ""  # the race's own note (why it ended) where it has one
    # the jobs the stop cancels: attempt, provider, role, job id, phase
    cancelling: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.outcome in (STOPPED, ALREADY_STOPPED, REVOKED)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def line(self) -> str:
        """One line for a person (the CLI's answer)."""
        rid = self.race_id
        if self.outcome in (STOPPED, ALREADY_STOPPED):
            jobs = ", ".join(
                f"{c['attempt']} {c['provider']} ({c['role']}) {c['phase']}"
                for c in self.cancelling
            )
            head = "stopped" if self.outcome == STOPPED else "already stopped"
            return (
                f"race {rid} {head} by {self.stopped_by}: its caller is failed, nothing more "
                f"launches; jobs cancelled: {jobs or 'none were live'} "
                f"(receipt: gpuhedge-celery receipt {rid})"
            )
        if self.outcome == ALREADY_FINISHED:
            how = f"won by {self.winner}" if self.winner else (self.note or "ended")
            return f"race {rid} had already finished ({how}): nothing to stop"
        if self.outcome == PENDING:
            return (
                f"race {rid}: stop sent, but no coordination worker applied it in time (it "
                "stays queued on gpuhedge.coord and applies when one takes it)"
            )
        if self.outcome == REVOKED:
            return f"race {rid} had not started: its hedged_infer task was revoked instead"
        return f"no race {rid!r} (unknown, not started yet, or expired)"


def read_stop(store: Any, race_id: str, by: str | None = None) -> StopAnswer:
    """What a stop finds in race ``race_id`` right now (``by``: the stopper waiting for its own
    stop, whose name marks the stop as its own: ``stopped``; anyone else's is
    ``already_stopped``). ``outcome`` is ``""`` for a race still running, not stopped."""
    record = store.load(race_id)
    if record is None:
        receipt = store.receipt(race_id)
        if receipt is None:
            return StopAnswer(race_id, UNKNOWN)
        note = receipt.get("note") or ""
        if receipt.get("stopped_by"):
            by, at = receipt["stopped_by"], receipt.get("stopped_at")
            return StopAnswer(race_id, ALREADY_STOPPED, by, at, note=note)
        winner = receipt.get("winner_provider")
        return StopAnswer(race_id, ALREADY_FINISHED, winner=winner, note=note)
    race = record.state.get("race") or {}
    stopped_by = race.get("stopped_by")
    if stopped_by is not None:
        cancelling = [
            {
                "attempt": a.get("id"),
                "provider": a.get("provider"),
                "role": a.get("role"),
                "job_id": a.get("job_id"),
                "phase": a.get("phase"),
            }
            for a in race.get("attempts") or []
            if a.get("cancel_reason") == STOP_REASON
        ]
        outcome = STOPPED if by is not None and stopped_by == by else ALREADY_STOPPED
        return StopAnswer(
            race_id,
            outcome,
            stopped_by,
            race.get("stopped_at"),
            note=race.get("note") or "",
            cancelling=cancelling,
        )
    winner = race.get("winner")
    if winner is not None or race.get("finished") or race.get("gave_up"):
        provider = next(
            (a.get("provider") for a in race.get("attempts") or [] if a.get("id") == winner), None
        )
        return StopAnswer(race_id, ALREADY_FINISHED, winner=provider, note=race.get("note") or "")
    return StopAnswer(race_id, "")
