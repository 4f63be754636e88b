"""The ``adaptive`` policy: a plan per request from a shared :class:`~.adaptive_learn.Learner`.

Name: ``adaptive:PRIMARY->HEDGE[,HEDGE...][@OPTIONS]``, options joined by ``+``: ``dNs`` the
deadline it serves (default 60 s), ``bR`` a hedge budget of R second jobs per request over the
long run. Examples: ``adaptive:runpod->cerebrium,modal``, ``adaptive:runpod->cerebrium@d45s+b0.2``.

A race takes its plan when it starts and keeps it in its own state, so every later hook is a
pure function of that state (a race resumed elsewhere plays the same plan). The plan's moves are
the built-ins': poll the primary at the cutover time and, still queued, cancel it and launch the
hedge; launch the hedge beside a running primary at the safety time; bring the backup in some
seconds after the hedge, or at once when the hedge fails. Launching a hedge spends a budget
token; without one the primary runs alone and the race is flagged ``hedge_budget_empty``.

The learner is not part of the policy's name or parameters: a replay hands the policy its own
(:meth:`AdaptivePolicy.use`); otherwise each process holds one per name (:func:`learner_for`),
in memory unless the live glue installed a factory sharing it through Redis
(:func:`set_learner_factory`, ``race/adaptive.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol

from ..errors import ConfigError
from .adaptive_fit import Plan
from .adaptive_learn import Learner
from .attempts import Attempt
from .jobs import JobState
from .policy_base import (
    FALLBACK,
    HEDGE,
    PRIMARY,
    PROVIDER_RE,
    AttemptView,
    Policy,
    RaceControl,
    bad_name,
    register_policy,
)
from .rates import PUBLISHED_RATES, ProviderRate

DEFAULT_DEADLINE_S = 60.0
BUDGET_EMPTY = "hedge_budget_empty"  # flag: a hedge was due but the budget had no token


class PlanSource(Protocol):
    """Where a race of the policy gets its plan and its hedge tokens: a :class:`Learner` in
    memory, or one shared through Redis by a fleet (``race/adaptive.py``)."""

    def next_request(self) -> tuple[int, Plan]: ...

    def take_token(self, key: str = "") -> bool:
        """Spend a hedge token for ``key`` (race and role); a key that has one already keeps
        it (True) without spending another."""
        ...


LearnerFactory = Callable[["AdaptivePolicy"], PlanSource]
_LEARNERS: dict[str, PlanSource] = {}


def _memory_learner(policy: AdaptivePolicy) -> PlanSource:
    return new_learner(policy)


_FACTORY: list[LearnerFactory] = [_memory_learner]


def learner_for(policy: AdaptivePolicy) -> PlanSource:
    """The learner this process uses for ``policy`` (made on first use)."""
    learner = _LEARNERS.get(policy.name)
    if learner is None:
        learner = _LEARNERS[policy.name] = _FACTORY[0](policy)
    return learner


def set_learner_factory(factory: LearnerFactory | None) -> None:
    """How learners are made for names not bound yet (None: in memory, published rates)."""
    _FACTORY[0] = factory or _memory_learner
    _LEARNERS.clear()


def new_learner(policy: AdaptivePolicy, rates: Mapping[str, ProviderRate] | None = None) -> Learner:
    """A learner that knows nothing yet, pricing with ``rates`` (default: published)."""
    return Learner(
        policy.primary,
        policy.hedges,
        policy.deadline_s,
        policy.budget,
        rates=PUBLISHED_RATES if rates is None else rates,
    )


@register_policy
class AdaptivePolicy(Policy):
    """Learns when, where and whether to hedge from the races it ran (see the module)."""

    kind = "adaptive"
    aliases: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        primary: str,
        hedges: list[str] | tuple[str, ...],
        deadline_s: float = DEFAULT_DEADLINE_S,
        budget: float | None = None,
    ):
        self.primary = primary
        self.hedges = tuple(hedges)
        if not self.hedges:
            raise ConfigError("an adaptive policy needs at least one hedge provider")
        if primary in self.hedges or len(set(self.hedges)) != len(self.hedges):
            raise ConfigError(f"adaptive providers must differ: {primary} -> {self.hedges}")
        if isinstance(deadline_s, bool) or not float(deadline_s) > 0:
            raise ConfigError(f"the adaptive deadline must be > 0 s, got {deadline_s!r}")
        self.deadline_s = float(deadline_s)
        if budget is not None and (isinstance(budget, bool) or not 0 <= float(budget) <= 10):
            raise ConfigError(f"the hedge budget must be within 0-10 per request, got {budget!r}")
        self.budget = None if budget is None else float(budget)
        self.learner: Learner | None = None  # None: this process's learner for the name

    def use(self, learner: Learner) -> AdaptivePolicy:
        """Plan from ``learner`` (a replay's own) instead of the process's; returns self."""
        self.learner = learner
        return self

    def _learner(self) -> PlanSource:
        return self.learner if self.learner is not None else learner_for(self)

    def providers(self) -> tuple[str, ...]:
        return (self.primary, *self.hedges)

    @property
    def name(self) -> str:
        options = [f"d{self.deadline_s:g}s"]
        if self.budget is not None:
            options.append(f"b{self.budget:g}")
        return f"adaptive:{self.primary}->{','.join(self.hedges)}@{'+'.join(options)}"

    def params(self) -> dict[str, Any]:
        return {
            "primary": self.primary,
            "hedges": list(self.hedges),
            "deadline_s": self.deadline_s,
            "budget": self.budget,
        }

    @classmethod
    def parse(cls, body: str) -> Policy:
        m = re.fullmatch(rf"({PROVIDER_RE})->({PROVIDER_RE}(?:,{PROVIDER_RE})*)(?:@(.+))?", body)
        if not m:
            raise bad_name("adaptive", body, "PRIMARY->HEDGE[,HEDGE...][@dNs+bR]")
        deadline, budget = DEFAULT_DEADLINE_S, None
        for option in m.group(3).split("+") if m.group(3) else ():
            d = re.fullmatch(r"d(\d+(?:\.\d+)?)s", option)
            b = re.fullmatch(r"b(\d+(?:\.\d+)?)", option)
            if d:
                deadline = float(d.group(1))
            elif b:
                budget = float(b.group(1))
            else:
                raise bad_name("adaptive", body, "PRIMARY->HEDGE[,HEDGE...][@dNs+bR]")
        return cls(m.group(1), m.group(2).split(","), deadline, budget)

    # ------------------------------------------------------------------ hooks
    def _plan(self, ctl: RaceControl) -> Plan:
        return Plan.from_dict(ctl.state["plan"])

    def on_start(self, ctl: RaceControl) -> None:
        seq, plan = self._learner().next_request()
        ctl.state["seq"] = seq
        ctl.state["plan"] = plan.to_dict()
        ctl.launch(self.primary, PRIMARY)

    def on_submitted(self, ctl: RaceControl, attempt: AttemptView) -> None:
        plan = self._plan(ctl)
        if attempt.role == PRIMARY and plan.poll_s is not None:
            ctl.set_timer("poll", plan.poll_s)
        if attempt.role == PRIMARY and plan.hedge is not None:
            if plan.cutover_s is not None:
                ctl.set_timer("cutover", plan.cutover_s)
            if plan.safety_s is not None:
                ctl.set_timer("safety", plan.safety_s)
        elif attempt.role == HEDGE and plan.backup is not None and plan.backup_s is not None:
            ctl.set_timer("backup", ctl.elapsed() + plan.backup_s)

    def _launch(self, ctl: RaceControl, role: str) -> bool:
        """Launch the plan's hedge or backup once, if the budget has a token; False if not
        (a later moment, such as the primary failing, may try again)."""
        plan = self._plan(ctl)
        provider = plan.hedge if role == HEDGE else plan.backup
        key = f"{role}_requested"
        if (
            provider is None
            or ctl.state.get(key)
            or ctl.has_winner
            or getattr(ctl, "gave_up", False)
        ):
            return False
        # keyed by race and role: a step applied again after a conflict spends no second token
        if not self._learner().take_token(f"{getattr(ctl, 'race_id', '')}:{role}"):
            ctl.flag(BUDGET_EMPTY)
            return False
        ctl.state[key] = True
        if role == HEDGE:
            ctl.clear_timer("cutover")
            ctl.clear_timer("safety")
        ctl.launch(provider, role)
        return True

    def on_timer(self, ctl: RaceControl, key: str) -> None:
        if key == "cutover" and not ctl.state.get("hedge_requested"):
            primary = ctl.attempt_for(PRIMARY)
            if primary is not None and primary.live:
                ctl.state["cutover_poll"] = primary.id
                ctl.poll(primary.id)
        elif key == "poll":
            primary = ctl.attempt_for(PRIMARY)
            if primary is not None and primary.live:
                ctl.poll(primary.id)  # only to learn its queue time: the answer decides nothing
        elif key == "safety":
            self._launch(ctl, HEDGE)
        elif key == "backup":
            primary = ctl.attempt_for(PRIMARY)
            if primary is not None and primary.live and not ctl.state.get("cut_over"):
                # the hedge runs beside a live primary: no slot until one of them fails (a
                # token spent now would only wait), so the backup joins then
                ctl.state["backup_due"] = True
            else:
                self._launch(ctl, FALLBACK)

    def on_status(
        self, ctl: RaceControl, attempt: AttemptView, state: JobState | None, error: str | None
    ) -> None:
        if ctl.state.get("cutover_poll") != attempt.id:
            return
        ctl.state["cutover_poll"] = None
        if state is JobState.QUEUED and error is None and not ctl.state.get("hedge_requested"):
            # the hedge first: without a budget token the queued primary is all there is
            if self._launch(ctl, HEDGE) and self._plan(ctl).cancel_queued:
                ctl.state["cut_over"] = True
                ctl.flag("cut_over")
                ctl.cancel(attempt.id, "cutover: still queued")

    def on_failed(self, ctl: RaceControl, attempt: AttemptView) -> None:
        if attempt.role == PRIMARY:
            if not self._launch(ctl, HEDGE) and ctl.state.get("backup_due"):
                self._launch(ctl, FALLBACK)
        elif attempt.role == HEDGE:
            self._launch(ctl, FALLBACK)


# ---------------------------------------------------------------------- what a race observed


def observe(seq: int, attempts: list[Attempt], ended_at: float) -> dict[str, Any]:
    """What a finished race saw of each job it sent, for :meth:`Learner.feed`.

    Only what the race itself observed: a result and when it came, poll answers (bounds on the
    queue time), and for a job stopped before its result, that it ran at least that long. A
    submit that failed is a failure of its provider at once; an attempt never sent (the budget
    refused it) says nothing about anyone.
    """
    jobs = []
    for a in attempts:
        if a.unsent:
            continue
        job: dict[str, Any] = {"provider": a.provider, "role": a.role}
        if a.submitted_at is None:
            end = a.result_at if a.result_at is not None else ended_at
            job.update(outcome="invalid", at=max(0.0, end - a.launched_at), queue_lo=0.0)
            job["queue_hi"] = None
            jobs.append(job)
            continue
        lo, hi = 0.0, None
        cancel_sent = cancel_ack = None
        for t, label in a.timeline:
            since = float(t) - a.submitted_at
            if label == JobState.QUEUED.value:
                lo = max(lo, since)
            elif label in (JobState.IN_PROGRESS.value, JobState.COMPLETED.value):
                hi = since if hi is None else min(hi, since)
            elif str(label).startswith("cancel_sent"):
                cancel_sent = float(t)
            elif label in ("cancel_acknowledged", "cancel_refused") and cancel_sent is not None:
                cancel_ack = float(t)
        good = bool(a.valid) and a.result_state == JobState.COMPLETED.value
        if a.result_at is not None and (good or a.cancel_sent_at is None):
            # a valid result counts even after our cancel; anything else after it is the cancel's
            job["outcome"] = "valid" if good else "invalid"
            job["at"] = a.result_at - a.submitted_at
            if good:
                hi = job["at"] if hi is None else min(hi, job["at"])
        else:
            stop = a.cancel_sent_at if a.cancel_sent_at is not None else ended_at
            job["outcome"] = "censored"
            job["at"] = max(0.0, stop - a.submitted_at)
        job["queue_lo"], job["queue_hi"] = lo, hi
        if cancel_sent is not None and cancel_ack is not None:
            job["cancel_s"] = cancel_ack - cancel_sent
        jobs.append(job)
    return {"seq": seq, "jobs": jobs}
