"""Adaptive policies in live races: one learner per policy name and process, fed from Redis.

Each coordinator process keeps a :class:`~gpuhedge_celery.core.adaptive_learn.Learner` per
adaptive policy name. It reads the policy's shared stream of observations (every finished race
of the policy appends what it saw, :func:`share_observation`) at most every ``SYNC_S`` seconds,
in the stream's order, so every coordinator learns from the same races; it refits then, when
something new came, and publishes its plan for ``policy show`` and the metrics. Request numbers
and hedge tokens come from Redis (:class:`~gpuhedge_celery.store.adaptive.AdaptiveStore`), so a
hedge budget holds for the whole fleet.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..core.adaptive import AdaptivePolicy, observe, set_learner_factory
from ..core.adaptive_fit import USD_WEIGHT, Plan
from ..core.adaptive_learn import Learner
from ..core.race import Race
from ..core.rates import ProviderRate
from ..store.adaptive import AdaptiveStore

log = logging.getLogger(__name__)

SYNC_S = 1.0  # seconds between two reads of the shared observations by one process


class SharedLearner:
    """A process's learner of one adaptive policy, kept in step with the fleet through Redis.

    It stands where a :class:`Learner` stands for the policy (``next_request``,
    ``take_token``); the policy never sees Redis.
    """

    def __init__(
        self,
        store: AdaptiveStore,
        policy: AdaptivePolicy,
        rates: Mapping[str, ProviderRate],
        time_scale: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store = store
        self.policy = policy
        self.rates = rates
        self.time_scale = time_scale
        self.clock = clock
        self.learner = self._fresh()
        self.after = "0-0"  # the last stream entry fed
        self.reset_seen: float | None = None
        self.synced_at = -float("inf")
        self._syncing = False
        self._lock = threading.Lock()  # race steps of one process plan from many threads

    def _fresh(self) -> Learner:
        p = self.policy
        weight = USD_WEIGHT * self.time_scale  # its p95 is real seconds, its dollars provider time
        return Learner(
            p.primary, p.hedges, p.deadline_s, p.budget, rates=self.rates, usd_weight=weight
        )

    def next_request(self) -> tuple[int, Plan]:
        with self._lock:  # one read of the stream at a time, however many races start
            due = not self._syncing and self.clock() - self.synced_at >= SYNC_S
            if due:
                self._syncing, self.synced_at = True, self.clock()
        if due:  # the read and the fit run beside the races: a fit may take a while
            threading.Thread(
                target=self._sync_quietly, name="gpuhedge-adaptive", daemon=True
            ).start()
        seq, tokens = self.store.next_request(self.policy.name, self.policy.budget)
        with self._lock:
            if tokens is not None:
                self.learner.tokens = tokens
            return seq, self.learner.planned(seq)

    def take_token(self, key: str = "") -> bool:
        if self.policy.budget is None:
            return True
        return self.store.take_token(self.policy.name, key)

    def _sync_quietly(self) -> None:
        try:
            self.sync()
        except Exception:  # the next request tries again; races keep the last plan meanwhile
            log.warning(
                "adaptive %s: reading what the fleet saw failed", self.policy.name, exc_info=True
            )
        finally:
            self._syncing = False

    def sync(self) -> None:
        """Feed what the fleet's races observed since the last read into a copy of the
        learner, refit and publish when anything came, then swap the copy in (a ``policy
        reset`` starts it again from nothing)."""
        name = self.policy.name
        reset = self.store.counts(name).get("reset", 0.0)
        with self._lock:
            working = Learner.from_dict(self.learner.to_dict(), self.rates)
            after = self.after
        if self.reset_seen is not None and reset != self.reset_seen:
            working, after = self._fresh(), "0-0"
        self.reset_seen = reset
        fed = 0
        for entry_id, observed in self.store.seen_since(name, after):
            after = entry_id
            try:
                working.feed(observed)
                fed += 1
            except (KeyError, TypeError, ValueError):
                log.warning("adaptive %s: an observation it cannot read was skipped", name)
        if fed or working.fitted_at < 0:
            working.fit()
            self.store.publish(name, working.summary())
        with self._lock:
            working.seq = max(working.seq, self.learner.seq)
            self.learner, self.after = working, after


def share_observation(store: AdaptiveStore, race: Race, now: float) -> None:
    """Append what a finished race of an adaptive policy observed to its policy's stream; a
    failure is logged (the race's own end must not wait on its policy's learning)."""
    policy = race.policy
    if not isinstance(policy, AdaptivePolicy) or "seq" not in race.state:
        return
    started = race.started_at if race.started_at is not None else now
    seen = observe(int(race.state["seq"]), race.attempts, max(0.0, now - started))
    try:
        store.append_seen(policy.name, seen)
    except Exception:
        log.warning(
            "race %s: its observation for %s was not shared",
            race.race_id,
            policy.name,
            exc_info=True,
        )


def install(
    store: AdaptiveStore,
    rates_for: Callable[[AdaptivePolicy], dict[str, Any]],
    time_scale: float = 1.0,
) -> None:
    """Make this process's adaptive policies learn through ``store`` (``rates_for``: each
    policy's provider rates per real second; ``time_scale``: the config's)."""
    set_learner_factory(lambda policy: SharedLearner(store, policy, rates_for(policy), time_scale))
