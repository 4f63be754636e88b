"""Budgets in a race: reserve before each submit, settle when each attempt ends.

The race driver calls three hooks, each a no-op when no cap is configured:

* :meth:`RaceBudget.reservation` before a submit: the attempt's worst case (its cap x rate,
  plus one idle window) queued on the submit claim's pipeline (no extra round trip). A refused
  attempt is not submitted: it ends with the refusal as its reason.
* :meth:`RaceBudget.on_step` when a step ends attempts: their settlements ride in that step's
  save (no extra round trip) and run only if it wins; :meth:`settle_race` settles a race's
  ready attempts on its own (the janitor, a capped job's late cancel).
* :meth:`RaceBudget.sweep` (the janitor): a reservation still open well past its worst-case
  window (its worker died, its race expired) settles from the race's state, or at its full
  amount when nothing shows the job stopped. Nothing stays reserved for ever.

The rules (worst case, which caps apply, what an attempt cost) are pure, in
:mod:`gpuhedge_celery.core.budget` and :mod:`gpuhedge_celery.core.settlement`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..core.attempts import LIVE_PHASES, Attempt, Phase
from ..core.budget import (
    REFUSED_PREFIX,
    BudgetCaps,
    cap_name,
    cap_slots,
    to_nano,
    utc_day,
    worst_case_usd,
)
from ..core.clock import Clock, WallClock
from ..core.outcome import unaccepted
from ..core.race import Race
from ..core.rates import ProviderRate
from ..core.settlement import RECONCILED, UNPROVEN, ready_to_settle, settle_attempt
from ..store.budget import MAX_NANO, BudgetStore, PendingReservation
from .attempts import UNKNOWN_SUBMIT
from .base import find_attempt

log = logging.getLogger(__name__)

DEFAULT_CAP_S = 180.0
MAX_USD = MAX_NANO / 1e9  # a larger reported cost converts as this (the script caps it anyway)
Items = list[tuple[str, int, str]]  # (attempt id, cost in nano-dollars, source)
LATE = "late"  # a second settlement, once, at the provider's own figure (budget_settle.lua)
LATE_ESTIMATE = "late_estimate"  # the same at our clock's figure: it never lowers the first


def _rate(spec: Mapping[str, Any], provider: str) -> ProviderRate:
    found = (spec.get("rates") or {}).get(provider) or {}
    return ProviderRate(float(found.get("rate_per_s", 0.0)), float(found.get("idle_s", 0.0)))


def _cap(spec: Mapping[str, Any], provider: str) -> float:
    return float((spec.get("caps_s") or {}).get(provider, DEFAULT_CAP_S))


def attempt_worst_case_usd(spec: Mapping[str, Any], provider: str) -> float:
    """The worst case of one attempt of ``provider`` in a race with this stored spec."""
    rate = _rate(spec, provider)
    return worst_case_usd(_cap(spec, provider), rate.rate_per_s, rate.idle_s)


def again(race: Race, items: Items) -> Items:
    """``items`` as second settlements: at the provider's own figure on a job shown ended by a
    read of the provider (``late``) the ledger follows it either way; otherwise
    (``late_estimate``: our clock, or a delivery nothing checked) it never lowers the first.
    An ``unproven`` job (a refused cancel's, a delivery nothing checked proves no end) keeps
    its whole reservation: settled as such, once."""

    def proven(attempt_id: str) -> bool:
        a = find_attempt(race, attempt_id)
        return a is not None and a.receipt is not None and a.receipt.confirmed_terminal

    def source(attempt_id: str, found: str) -> str:
        if found == UNPROVEN:
            return UNPROVEN
        return LATE if found == RECONCILED and proven(attempt_id) else LATE_ESTIMATE

    return [(aid, nano, source(aid, src)) for aid, nano, src in items]


def _accepted_leak(a: Attempt) -> bool:
    """A leaked job whose provider accepted its cancel: it settles at its price to the
    acknowledgement (see core/settlement.py), until a late result says more."""
    return a.phase is Phase.LEAKED and not unaccepted(a)


class RaceBudget:
    """The budget hooks of one process: its caps (from config) over the ledger in Redis."""

    def __init__(self, store: BudgetStore, caps: BudgetCaps, clock: Clock | None = None):
        self.store = store
        self.caps = caps
        self.clock = clock or WallClock()

    @property
    def enabled(self) -> bool:
        return self.caps.enabled

    # ------------------------------------------------------------------ before a submit
    def reservation(
        self, race_id: str, a: Attempt, state: Mapping[str, Any]
    ) -> PendingReservation | None:
        """The attempt's reservation, to queue with the submit claim (None: budgets are off)."""
        if not self.enabled:
            return None
        spec = state.get("spec") or {}
        now = self.clock.now()
        key = spec.get("budget_key")
        rate = _rate(spec, a.provider)
        cap_s = _cap(spec, a.provider)
        provider, caps = a.provider, self.caps
        return self.store.prepare(
            race_id,
            a.id,
            amount_usd=worst_case_usd(cap_s, rate.rate_per_s, rate.idle_s),
            day=utc_day(now),
            provider=provider,
            key=key,
            role=a.role,
            caps_nano=cap_slots(caps, provider, key),
            cap_name=lambda slot: cap_name(caps, provider, key, slot),
            open_until_ms=int((now + cap_s + rate.idle_s) * 1000),
        )

    # ------------------------------------------------------------------ when attempts end
    def settlements(
        self, race: Race, state: Mapping[str, Any], attempts: list[Attempt], *, force: bool = False
    ) -> Items:
        """What each attempt cost, for :meth:`BudgetStore.settle` (ready ones; all if forced)."""
        spec = state.get("spec") or {}
        results = state.get("results") or {}
        items: Items = []
        for a in attempts:
            if a.reasons and a.reasons[0].startswith(REFUSED_PREFIX):
                continue  # refused: it never held a reservation
            summary = results.get(a.id)
            if not force and not ready_to_settle(a, summary):
                continue
            rate = _rate(spec, a.provider)
            cap_s = _cap(spec, a.provider)
            reserved = worst_case_usd(cap_s, rate.rate_per_s, rate.idle_s)
            if force and not ready_to_settle(a, summary) and not _accepted_leak(a):
                items.append((a.id, to_nano(reserved, round_up=True), UNPROVEN))  # still live
                continue
            if UNKNOWN_SUBMIT in a.reasons:  # its worker died mid-submit: a job may exist
                items.append((a.id, to_nano(reserved, round_up=True), UNPROVEN))
                continue
            start = race.started_at if race is not None else None
            found = settle_attempt(a, rate, cap_s, reserved, summary, started_at=start)
            # above the reservation: the script settles at it and counts it (o|<provider>)
            items.append((a.id, to_nano(min(found.usd, MAX_USD)), found.source))
        return items

    def on_step(
        self,
        race_id: str,
        race: Race,
        state: Mapping[str, Any],
        before: Mapping[str, Phase],
        saved: tuple[str, str],
    ) -> tuple[Callable[[Any, bool], None], Any] | None:
        """Settlements of the attempts this step ended, to ride in its save (or None), as
        :meth:`RoundTrip.ride_won <gpuhedge_celery.store.round_trip.RoundTrip.ride_won>`
        takes them (on a cluster, after the save won, in a round trip of their own).

        ``saved``: the save's mark (:meth:`RaceStore.save_mark`): they settle only if that
        save wins. One that loses was computed from an old copy of the race, and a
        reservation settles once, so its figure would stick; the step is then decided again
        on the current state, and whichever save wins carries the settlement that counts.
        """
        if not self.enabled:
            return None
        ended = [a for a in race.attempts if a.id not in before or before[a.id] in LIVE_PHASES]
        # an accepted cancel nothing can confirm settles at once, to its acknowledgement; a
        # late result of that job settles it again, once, at its own price
        accepted = [a for a in ended if _accepted_leak(a) and before.get(a.id) is not Phase.LEAKED]
        late = [a for a in ended if not a.live and before.get(a.id) is Phase.LEAKED]
        items = self.settlements(race, state, [a for a in ended if not a.live and a not in late])
        items += self.settlements(race, state, accepted, force=True)
        items += again(race, self.settlements(race, state, late))
        if not items:
            return None
        now_ms = int(self.clock.now() * 1000)

        def queue(pipe: Any, known: bool) -> None:  # known: sent after the save won
            self.store.queue_settle(pipe, race_id, items, now_ms, only_if=None if known else saved)

        return queue, self.store.settle_script

    def settle_race(
        self, race_id: str, race: Race, state: Mapping[str, Any], resettle: Collection[str] = ()
    ) -> int:
        """Settle every attempt of the race that can no longer cost more (one round trip).

        ``resettle``: attempts whose new figure may replace the one they settled at while leaked
        (the janitor's cancel of a finished race's leak): settled again, once (:func:`again`).
        """
        if not self.enabled:
            return 0
        items = self.settlements(race, state, list(race.attempts))
        items = [
            *again(race, [i for i in items if i[0] in resettle]),
            *(i for i in items if i[0] not in resettle),
        ]
        count, _ = self.store.settle(race_id, items, int(self.clock.now() * 1000))
        return count

    # ------------------------------------------------------------------ the janitor's sweep
    def sweep(
        self, load_state: Callable[[str], Mapping[str, Any] | None], grace_ms: int, limit: int = 100
    ) -> int:
        """Settle reservations open ``grace_ms`` past their worst-case window; returns how many.

        From the race's state where it still exists (an ended attempt settles as usual; one
        still live that long is kept as spent at its full reservation), else at the full
        reservation: a settlement that frees nothing it cannot show was not spent.
        """
        now_ms = int(self.clock.now() * 1000)
        settled = 0
        for record in self.store.open_due(now_ms - grace_ms, limit):
            race_id, attempt_id = record.get("race", ""), record.get("attempt", "")
            state = load_state(race_id) if race_id else None
            items: Items = []
            if state is not None:
                race = Race.from_dict(state["race"], self.clock)
                a = find_attempt(race, attempt_id)
                if a is not None:
                    items = self.settlements(race, state, [a], force=True)
            if not items:  # its race is gone: kept as spent
                items = [(attempt_id, int(record.get("amount") or 0), UNPROVEN)]
            count, _ = self.store.settle(race_id, items, now_ms)
            settled += count
            if count:
                log.warning(
                    "budget: reservation %s settled by the janitor (%s)",
                    record.get("id"),
                    items[0][2],
                )
        return settled
