"""A webhook delivery, turned into the engine event a poll would have produced.

The provider parses the body (``webhook_result(handle, body)``: the job's ``AttemptResult``, or
None while the job has not ended). Where the provider has an authenticated read of the job
(RunPod's ``/status``), the delivery is only a wake-up: that read's answer is what is applied,
so a forged body with a leaked URL changes nothing (docs/providers.md). The race driver's
:meth:`conclude` applies it, exactly as a watch poll that saw the job end: the result
validated, stored, reported with one versioned save of the race, and the engine's actions
(a winner, the losers' cancels) performed. :func:`apply_delivery` returns only after that
save, so a provider's retry covers a receiver that dies first; a repeated delivery finds the
attempt ended and changes nothing. With replicas to wait for (``GPUHEDGE_REDIS_WAIT_REPLICAS``),
an outcome they do not hold yet is answered 503, and the provider's retry of the winner's
delivery declares it again (the race's tell timer tells it too, whatever the provider does).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ..core.attempts import Phase
from ..core.jobs import JobHandle
from ..core.race import Race
from ..errors import GpuHedgeError, ProviderError, ProviderProtocolError
from ..providers.base import TakesWebhooks
from ..race.base import JobRef, find_attempt
from ..store.replicas import NotAcknowledged

if TYPE_CHECKING:
    from ..race.driver import RaceDriver

log = logging.getLogger(__name__)

HANDLE_WAIT_S = 2.0  # a fast job's delivery may beat its submit's registration
HANDLE_POLL_S = 0.05

Answer = tuple[int, dict[str, Any]]


def apply_delivery(
    driver: RaceDriver,
    race_id: str,
    attempt_id: str,
    body: Any,
    *,
    handle_wait_s: float = HANDLE_WAIT_S,
) -> Answer:
    """Apply one authenticated delivery; the HTTP status and a small JSON answer."""
    deadline = time.monotonic() + handle_wait_s
    while True:
        record, jobs = driver.store.load_with_jobs(race_id)
        if record is None:
            return 200, {"ignored": "no such race (finished and expired, or never created)"}
        race = Race.from_dict(record.state["race"], driver.clock)
        a = find_attempt(race, attempt_id)
        if a is None:
            return 200, {"ignored": f"race has no attempt {attempt_id!r}"}
        if not a.live:
            if race.winner == attempt_id and driver.store.acks.on:
                return _declare_again(driver, race_id)
            return 200, {"ignored": "attempt already ended"}
        if race.finished and a.phase is not Phase.LEAKED:
            return 200, {"ignored": "race finished"}  # only a job never shown stopped is news
        data = a.handle or jobs.get(attempt_id)
        if data and not data.get("submitting"):
            break
        if time.monotonic() >= deadline:
            # Not a 5xx: some platforms never retry one. The watch's fallback poll (or the
            # race's deadline) settles the attempt if no retry comes.
            return 409, {"error": "the job's submit is not registered yet; retry later"}
        time.sleep(HANDLE_POLL_S)
    handle = JobHandle.from_dict(data)
    provider = driver.providers(a.provider)
    if not isinstance(provider, TakesWebhooks):
        return 400, {"error": f"provider {a.provider!r} ({provider.adapter}) takes no webhooks"}
    try:
        result = provider.webhook_result(handle, body)
    except ProviderProtocolError as e:  # the body is not this job's status
        return 400, {"error": _line(str(e))}
    except ProviderError as e:  # the provider could not be asked to confirm it: retry later
        log.warning("race %s: webhook for %s not verified: %s", race_id, attempt_id, _line(str(e)))
        return 503, {"error": "try again"}  # the why stays in this log
    except GpuHedgeError as e:
        return 400, {"error": _line(str(e))}
    except Exception as e:  # an unforeseen body shape: refused, never a crash of the receiver
        log.warning("race %s: unreadable webhook for %s: %r", race_id, attempt_id, e)
        return 400, {"error": f"unreadable body ({type(e).__name__})"}
    if result is None:
        return 200, {"ignored": "the job has not ended"}
    spec = record.state["spec"]
    cap = float((spec.get("caps_s") or {}).get(a.provider, 180.0))
    try:
        driver.conclude(
            JobRef(race_id, attempt_id, a.provider, handle.to_dict(), cap), spec, result
        )
    except NotAcknowledged as e:  # saved, but the outcome it made is not told yet
        log.warning(
            "race %s: webhook for %s saved, but the outcome is not held by the Redis replicas"
            " yet (503): %s",
            race_id,
            attempt_id,
            _line(str(e)),
        )
        return 503, {"error": "try again"}  # like every 503: the why stays in this log
    return 200, {"applied": str(result.state)}


def _declare_again(driver: RaceDriver, race_id: str) -> Answer:
    """A repeated delivery of the winner's job, with replicas to wait for: the step that
    declared it may have found them short (and answered 503), so the caller is told again
    (idempotent: the effects tell nobody twice)."""
    try:
        driver.outcome.retell(race_id)
    except NotAcknowledged as e:
        log.warning(
            "race %s: winner's webhook again, its outcome still not held by the Redis replicas"
            " (503): %s",
            race_id,
            _line(str(e)),
        )
        return 503, {"error": "try again"}
    return 200, {"ignored": "attempt already ended; its win declared again"}


def _line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]
