"""A terminal job's result: fetched, validated once, stored once, reported to its race.

The race driver's :class:`Concluder`.

* **Validated once.** The process that fetched the result runs the race's validator on it, here
  and nowhere else, and only when the race takes the report (a late or duplicate result of an
  attempt that already ended is never decoded). The verdict travels with the result: a valid
  result is stored (at :func:`~gpuhedge_celery.race.receipt.result_key`) with its ``verdict``
  and its payload's JSON size (``payload_bytes``), and the race's state keeps the summary
  (valid, reasons). The step that declares the winner, the receipt and the caller's result
  read those; none of them decodes or validates the payload again.
* **Stored once.** The valid result is written in the round trip of the step that reports it,
  ahead of the state (so any process that sees the report can serve it). A report the race
  does not take (the attempt had already ended, the race had finished) is not stored: that
  result can never win. The caller's Celery result refers to this key rather than carrying a
  second copy (``tasks/race_backend.py``).
* **A signature proves an end.** A delivery nothing can check with its provider (a Cerebrium
  webhook) ends a job we were cancelling only as far as the race's decisions go: its job is
  not shown stopped (core/race.py). With the ``hmac`` validator, a completed result whose
  signature verifies is the user's function's own output, so it shows the run ended as
  surely as a provider's read would, and is taken as verified (its receipt, record and ledger
  then follow it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..core.attempts import Phase
from ..core.jobs import AttemptResult, JobState
from ..core.race import Race
from ..core.race_events import AttemptSubmitted, Event, ResultArrived, StatusObserved
from ..core.validators import validate
from ..core.validators_signed import SIGNATURE_PROVES_END, signature_of, signature_verified
from ..store import codec
from ..store.round_trip import RoundTrip
from .base import JobRef, find_attempt, remember
from .receipt import load_attempt_result, result_key

if TYPE_CHECKING:
    from .base import Driver

log = logging.getLogger(__name__)


def checked_result(
    result: AttemptResult, spec: dict[str, Any]
) -> tuple[bool, list[str], dict[str, Any] | None, str | None]:
    """``(valid, reasons, stored, data)``: the one validation of a result; ``stored`` is what a
    valid result is kept as (the result, its verdict and its payload's JSON size) and ``data``
    that as the JSON the store writes, else None. A result the store cannot encode (nested
    deeper than the encoder goes, say) is invalid: it could never be saved, so never win."""
    if result.state is not JobState.COMPLETED:
        return False, [result.error or f"ended {result.state}"], None, None
    verdict = validate(spec["validator"], result.payload, **(spec.get("validator_options") or {}))
    if not verdict.ok:
        return False, list(verdict.reasons), None, None
    stored = result.to_dict()
    try:
        stored["payload_bytes"] = codec.size(result.payload)
        stored["verdict"] = verdict.to_dict()
        data = codec.dumps(stored)
    except (TypeError, ValueError, RecursionError) as e:
        return (
            False,
            [f"result cannot be stored as JSON ({' '.join(str(e).split())[:120]})"],
            None,
            None,
        )
    return True, [], stored, data


class Concluder:
    """A terminal job's result, to its race."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver

    def signed_end(
        self, race: Race, attempt_id: str, result: AttemptResult, spec: dict[str, Any]
    ) -> bool:
        """Whether ``result``, delivered where nothing checks it with the provider, shows its
        run ended by its signature: completed, signed with the key the fleet's config names
        (a message cannot choose it: ``signature_proves_end`` is set from the config), and no
        copy of another attempt's stored result (the winner's output, replayed to a loser's
        URL, must not pass for the loser's end). Any error reading it: not shown."""
        if result.state is not JobState.COMPLETED or not spec.get(SIGNATURE_PROVES_END):
            return False
        d = self.driver
        try:
            if not signature_verified(result.payload, spec):
                return False
            mine = signature_of(result.payload, spec)
            for other in race.attempts:
                if other.id == attempt_id or not other.valid:
                    continue
                stored = load_attempt_result(d.store.client, d.store.shards, race.race_id, other.id)
                if stored is not None and signature_of(stored.get("payload"), spec) == mine:
                    log.warning(
                        "race %s: %s delivered a copy of %s's signed result: not its end",
                        race.race_id,
                        attempt_id,
                        other.id,
                    )
                    return False
        except Exception as e:  # a body the check cannot read proves nothing
            log.warning("race %s: %s's signature not checked: %r", race.race_id, attempt_id, e)
            return False
        return True

    def conclude(
        self, ref: JobRef, spec: dict[str, Any] | None = None, result: AttemptResult | None = None
    ) -> None:
        """Fetch a terminal (or capped) job's result, validate it and report it to the race.

        ``spec``: the race's spec when the caller has it at hand (no read). ``result``: the
        job's result as its webhook delivered it (nothing to fetch).
        """
        d = self.driver
        race_id, attempt_id, cap_s = ref.race_id, ref.attempt_id, ref.cap_s
        provider, handle = d.providers(ref.provider), ref.job
        delivered = result
        try:
            if result is None:  # returns at once: terminal or past the cap
                result = provider.result(handle, cap_s)
        except Exception as e:
            result = AttemptResult(
                provider.name,
                handle.job_id,
                JobState.FAILED,
                provider.elapsed_ms(handle),
                error=f"{type(e).__name__}: {e}",
            )
        if spec is None:
            # A race's spec never changes: this process's last saved copy serves (no read).
            record = d.store.load(race_id, fresh=True)
            if record is None:
                return
            spec = record.state["spec"]
        # Validated when the race takes the report, and only then (a late or duplicate result
        # of an attempt that already ended is never decoded): once, whatever the step retries.
        checked: list[tuple[bool, list[str], dict[str, Any] | None, str | None]] = []
        key = result_key(d.store.shards, race_id, attempt_id)

        def check() -> tuple[bool, list[str], dict[str, Any] | None, str | None]:
            if not checked:
                valid, reasons, stored, data = checked_result(result, spec)
                if stored is not None:
                    # The step may declare this attempt the winner: spare it the read back.
                    remember(d.outcome.fresh_results, (race_id, attempt_id), stored)
                checked.append((valid, reasons, stored, data))
            return checked[0]

        tries: list[int] = [0, 0]  # step attempts seen by ``event``; the one ``keep`` wrote in
        # a delivery nothing checked with the provider ends a job, but proves no cancel (unless
        # the function signed it: see the module doc)
        checked_by_provider = delivered is None or provider.delivery_is_verified
        proof: list[bool] = []
        late: list[bool] = [False]

        def vouched(race: Race) -> bool:
            """Whether this result shows its job ended: read from the provider, or signed."""
            if checked_by_provider:
                return True
            if not proof:
                proof.append(self.signed_end(race, attempt_id, result, spec))
            return proof[0]

        def event(race: Race) -> Event | tuple[Event, ...] | None:
            tries[0] += 1
            a = find_attempt(race, attempt_id)
            if a is None or not a.live:
                return None
            if race.finished:  # a loser's late result: it prices the job, it can never win
                if result.state is JobState.TIMEOUT:
                    return None  # our cap passed: no sign of the job's end, nothing to price
                if checked_by_provider and result.state is not JobState.COMPLETED:
                    return None  # a readable end the janitor's cancel confirms, with receipt
                late[0] = True
                return ResultArrived(attempt_id, result.state, False, (), verified=vouched(race))
            if (
                a.phase in (Phase.CANCELLING, Phase.LEAKED)
                and result.state is not JobState.COMPLETED
            ):
                if result.state is JobState.TIMEOUT:
                    return None  # right-censored, not observed terminal: the cancel decides
                if checked_by_provider:
                    return StatusObserved(attempt_id, result.state)  # confirms the cancel
                return ResultArrived(attempt_id, result.state, False, (), verified=False)
            valid, reasons, _, _ = check()
            # only a job we were cancelling needs its end shown (a running one's result is news)
            shown = vouched(race) if a.receipt is not None else checked_by_provider
            arrived = ResultArrived(attempt_id, result.state, valid, tuple(reasons), verified=shown)
            if a.phase is Phase.LAUNCHING:  # its submit's report died with its process
                return (AttemptSubmitted(attempt_id, handle.job_id, handle.to_dict()), arrived)
            return arrived

        def note(state: dict[str, Any]) -> None:
            valid, reasons, _, _ = check()
            summary = {**result.to_dict(include_payload=False), "valid": valid, "reasons": reasons}
            state["results"] = {**(state.get("results") or {}), attempt_id: summary}

        ttl_ms = int(d.settings.receipt_ttl_s * 1000)

        def keep(pipe: Any) -> None:
            # In the round trip of the save that reports the result, ahead of the state; a
            # step that saves nothing took no report and stores nothing (a result that cannot
            # win). A step that tries again after a version conflict does not send it again:
            # the conflicting save's round trip ran whole (Redis runs every command of a
            # pipeline; the conflict is the save script's answer), so the result is stored.
            if late[0]:
                return  # a late result is never served: not stored
            data = check()[3]
            if data is None or 0 < tries[1] < tries[0]:
                return
            tries[1] = tries[0]
            pipe.set(key, data, px=ttl_ms)

        trip = RoundTrip()
        if result.state is JobState.COMPLETED:
            trip.ahead(keep)
        saved = d.step(race_id, event, note, trip)
        # A winner's step has used it (a later declaration reads the stored result back).
        d.outcome.fresh_results.pop((race_id, attempt_id), None)
        a = find_attempt(saved, attempt_id) if saved is not None else None
        if a is not None and a.phase is Phase.ENDED and a.result_state == JobState.TIMEOUT.value:
            # Capped, not stopped: the job may still be running (and billing) at the provider.
            d.canceller.request_cancel(race_id, attempt_id, provider.name)
