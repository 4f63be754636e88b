"""What an adaptive policy has learned, and the plan it gives the next request.

A :class:`Learner` keeps, per provider, the recent jobs it saw (:class:`~.adaptive_fit.Sample`),
the hedge budget's tokens, the providers in alarm, and the plan the last fit chose. Races take a
plan when they start (:meth:`Learner.next_request`) and hand back what they observed when they
finish (:meth:`Learner.feed`); calibration rounds, where every provider ran the same request,
are fed whole (:meth:`Learner.feed_paired`). Everything is JSON-safe (:meth:`to_dict`), so the
same state can live in memory (replay) or in Redis shared by every coordinator (live).

Rules, each a line of the docs' learning rule:

* the plan minimises the estimated objective (:mod:`.adaptive_fit`) over a grid of hedges,
  backups (one of them: both hedges at once), times and whether a queued primary is kept; it
  is refitted every ``REFIT_EVERY`` requests and at once on an alarm;
* a plan within ``SWITCH_MARGIN`` of the best stays: the current one, or else the same plan
  keeping a queued primary beside its hedge (never slower, and it shows what queued jobs do);
* a provider whose last jobs mostly failed is in alarm: not used as the hedge for
  ``ALARM_COOLDOWN`` requests (the fit's average would take many more to move), though it may
  still back one up;
* a hedge provider not watched for ``STALE_AGE`` requests races once beside the plan's hedge
  (a plan with a cutover) or in its place (one whose hedge joins a live primary), so one that
  recovered is noticed; a probe that launched nothing is due again; every
  ``PRIMARY_PROBE``-th request whose plan cancels a queued primary keeps it instead, so a
  change in what queued jobs do is noticed;
* a hedge budget ``R`` is a token bucket: ``R`` tokens a request, at most ``CAPACITY``, one per
  hedge or backup launched; a plan that would launch more is scored as the bucket will run it
  (the requests beyond ``R`` run the primary alone), and a plan that spends its tokens only on
  stuck primaries (late, or still queued) wins that way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .adaptive_fit import (
    INF,
    MISS_SHARE,
    USD_WEIGHT,
    Estimate,
    Plan,
    Point,
    Sample,
    Scene,
    decimal_step,
    effective_size,
    estimate,
    grid,
    quantiles,
    weights,
)
from .adaptive_fit import points as to_points
from .rates import ProviderRate

CAPACITY = 10.0  # hedge tokens the bucket holds at most (and starts with)
TOOK_KEPT = 1024  # race/role keys remembered as having spent a token
HALF_LIFE = 20.0  # newer samples of the same provider after which a sample weighs half
KEEP = 256  # samples kept per provider (the primary's rare long jobs must stay in view)
MIN_SAMPLES = 3  # below this, a provider is explored before it is judged
REFIT_EVERY = 4  # requests between fits
SWITCH_MARGIN = 0.05  # a fitted plan replaces the current one only when this much better
ALARM_WINDOW, ALARM_FAILS, ALARM_COOLDOWN = 3, 2, 25
STALE_AGE = 60  # requests without a finished job after which a provider is probed again
PROBE_GAP = 50  # requests between two probes of one provider
PRIMARY_PROBE = 10  # every this many requests a cutover keeps the queued primary beside the hedge
# Candidate times, in seconds for a 60 s deadline and scaled with the policy's own (a sim fleet
# on compressed time serves a deadline of a second or two); the samples add their own.
CUTOVER_GRID = (1.0, 2.0, 3.0, 5.0, 10.0)
SAFETY_GRID = (1.0, 2.0, 8.5, 20.0, 30.0)
BACKUP_GRID = (10.0, 30.0)
DEFAULT_PLAN_TIMES = (2.5, 8.5)  # cutover and safety before the primary is known
# A job watched this long (scaled likewise) without ending may hang; one stopped sooner, as a
# hedge explored beside a fast primary is, was cut short and still counts as worth a try.
HANG_WATCH_S = 3.0
GRID_DEADLINE_S = 60.0


Rank = tuple[int, float, float]


class _Scores:
    """Every plan one fit scored, each estimated once."""

    def __init__(
        self, scene: Scene, budget: float | None, rank: Callable[[Estimate], Rank]
    ) -> None:
        self.scene, self.budget, self.rank = scene, budget, rank
        self.seen: dict[Plan, tuple[Rank, Estimate]] = {}

    def __call__(self, plan: Plan) -> tuple[Rank, Estimate]:
        found = self.seen.get(plan)
        if found is None:
            est = estimate(self.scene, plan, self.budget)
            found = self.seen[plan] = (self.rank(est), est)
        return found

    def least(self, plans: Iterable[Plan]) -> Plan:
        return min(plans, key=lambda p: self(p)[0])

    def best(self, keep: Callable[[Plan], bool] = lambda p: True) -> tuple[Plan, Estimate]:
        """The best plan scored (among those ``keep`` accepts; no hedge when none is)."""
        found = [(r, p, e) for p, (r, e) in self.seen.items() if keep(p)]
        if not found:
            return Plan(), self(Plan())[1]
        _, plan, est = min(found, key=lambda x: x[0])
        return plan, est


@dataclass
class Learner:
    """The learned state of one adaptive policy (one name)."""

    primary: str
    hedges: tuple[str, ...]
    deadline_s: float
    budget: float | None = None  # hedges per request over the long run
    rates: Mapping[str, ProviderRate] = field(default_factory=dict)
    usd_weight: float = USD_WEIGHT  # p95 seconds one dollar per request is worth
    seq: int = 0  # requests planned so far
    tokens: float = CAPACITY
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    cancel_s: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    alarm_until: dict[str, int] = field(default_factory=dict)
    alarm_for: dict[str, int] = field(default_factory=dict)  # the last alarm's length
    plan: Plan = field(default_factory=Plan)
    keep_plan: Plan = field(default_factory=Plan)  # the best plan keeping a queued primary
    estimate: Estimate | None = None
    fitted_at: int = -1
    races: int = 0  # finished races fed
    paired: int = 0  # calibration rounds fed
    probed_at: dict[str, int] = field(default_factory=dict)
    took: dict[str, None] = field(default_factory=dict)  # keys that spent a token, oldest first

    # ------------------------------------------------------------------ per request
    def next_request(self) -> tuple[int, Plan]:
        """The next request's number and plan (from what was fed before it)."""
        self.seq += 1
        if self.budget is not None:
            self.tokens = min(CAPACITY, self.tokens + self.budget)
        if self.fitted_at < 0 or self.seq - self.fitted_at >= REFIT_EVERY:
            self.fit()
        return self.seq, self._with_probe(self.plan)

    def planned(self, seq: int) -> Plan:
        """The plan of request ``seq`` numbered elsewhere (a fleet shares one counter), from
        the last fit: whoever shares the learner decides when to fit."""
        self.seq = max(self.seq, seq)
        if self.fitted_at < 0:
            self.fit()
        return self._with_probe(self.plan)

    def take_token(self, key: str = "") -> bool:
        """Spend a hedge token; False (and nothing spent) when the bucket is empty. A key
        that took one already (the same race and role, its step applied again) keeps it."""
        if self.budget is None:
            return True
        if key and key in self.took:
            return True
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        if key:
            self.took[key] = None
            while len(self.took) > TOOK_KEPT:
                del self.took[next(iter(self.took))]
        return True

    # ------------------------------------------------------------------ learning
    def feed_paired(self, seq: int, arms: Mapping[str, tuple[float, bool, float | None]]) -> None:
        """A calibration round: every provider's (wall seconds, valid, queue delay or None)."""
        for provider, (wall_s, valid, queue) in arms.items():
            lo, hi = (
                (queue, queue) if queue is not None and provider == self.primary else (0.0, INF)
            )
            self._add(provider, Sample(seq, wall_s, "valid" if valid else "invalid", lo, hi))
        self.paired += 1

    def feed(self, observed: Mapping[str, Any]) -> None:
        """What one finished race observed (:func:`~.adaptive.observe`)."""
        seq = int(observed["seq"])
        alarmed = False
        for job in observed.get("jobs", ()):
            provider = str(job["provider"])
            lo, hi = float(job.get("queue_lo", 0.0)), job.get("queue_hi")
            if provider != self.primary:
                lo, hi = 0.0, None  # only the primary's queue time decides a cutover
            sample = Sample(
                seq, float(job["at"]), str(job["outcome"]), lo, INF if hi is None else float(hi)
            )
            self._add(provider, sample)
            if sample.outcome != "censored" and self._check_alarm(provider):
                alarmed = True
            if job.get("cancel_s") is not None:
                kept = self.cancel_s.setdefault(provider, [])
                kept.append((seq, float(job["cancel_s"])))
                del kept[:-KEEP]
        self.races += 1
        ran = {str(job["provider"]) for job in observed.get("jobs", ())}
        for provider in [p for p, at in self.probed_at.items() if at == seq and p not in ran]:
            del self.probed_at[provider]  # its probe launched nothing: the next request's tries
        if alarmed:
            self.fit()

    def _add(self, provider: str, sample: Sample) -> None:
        kept = self.samples.setdefault(provider, [])
        kept.append(sample)
        del kept[:-KEEP]

    def _check_alarm(self, provider: str) -> bool:
        """Raise the provider's alarm when most of its last jobs failed; True if newly raised."""
        last = [s for s in self.samples.get(provider, ()) if s.outcome != "censored"]
        last = last[-ALARM_WINDOW:]
        fails = sum(1 for s in last if s.outcome == "invalid")
        if len(last) == ALARM_WINDOW and fails >= ALARM_FAILS and not self.in_alarm(provider):
            # failing again soon after its last alarm: twice as long out (at most 8 times)
            previous = self.alarm_for.get(provider, 0)
            recent = self.seq - self.alarm_until.get(provider, -(10**9)) < ALARM_COOLDOWN
            length = (
                min(previous * 2, 8 * ALARM_COOLDOWN) if recent and previous else ALARM_COOLDOWN
            )
            self.alarm_for[provider] = length
            self.alarm_until[provider] = self.seq + length
            return True
        return False

    def in_alarm(self, provider: str) -> bool:
        return self.alarm_until.get(provider, -1) > self.seq

    def cancel_latency(self, provider: str) -> float:
        """The weighted median seconds from a cancel's send to its acknowledgement."""
        kept = self.cancel_s.get(provider, [])
        if not kept:
            return 0.0
        memory = weights(len(kept), HALF_LIFE)
        pairs = sorted(zip((s for _, s in kept), memory, strict=True))
        half, run = sum(w for _, w in pairs) / 2, 0.0
        for s, w in pairs:
            run += w
            if run >= half:
                return s
        return pairs[-1][0]

    def last_seen(self, provider: str) -> int:
        """The request that last watched a job of ``provider`` end, or run long enough to
        show whether it hangs; -1 if none."""
        hang_s = self._scaled((HANG_WATCH_S,))[0]
        for s in reversed(self.samples.get(provider, ())):
            if s.outcome != "censored" or s.at >= hang_s:
                return s.seq
        return -1

    # ------------------------------------------------------------------ the fit
    def fit(self) -> None:
        """Choose the plan with the best estimated objective from what was fed so far."""
        self.fitted_at = self.seq
        usable = [h for h in self.hedges if not self.in_alarm(h)]
        unknown = [h for h in usable if len(self.samples.get(h, ())) < MIN_SAMPLES]
        if len(self.samples.get(self.primary, ())) < MIN_SAMPLES or unknown:
            cut, safety = self._scaled(DEFAULT_PLAN_TIMES)
            if unknown:
                # a hedge never seen runs beside the primary from the start: the only way to
                # learn it (a few requests' worth, MIN_SAMPLES each); on a budget, only beside
                # a primary that is stuck, where a token is worth spending, and never instead
                # of it (it may be dead): a known hedge joins if either fails
                hedge = unknown[self.seq % len(unknown)]
                known = [h for h in usable if h not in unknown]
                backup, backup_s = (known[0], 0.0) if known else (None, None)
                first = Plan(hedge, None, None, 0.0) if self.budget is None else None
                self.plan = first or Plan(hedge, backup, cut, safety, backup_s, cancel_queued=False)
                self.estimate = None
                return
            self.plan, self.estimate = Plan(usable[0] if usable else None, None, cut, safety), None
            return
        seen = [h for h in self.hedges if len(self.samples.get(h, ())) >= MIN_SAMPLES]
        scene = self._scene(seen)
        score = _Scores(scene, self._affordable(), self._rank)
        self._candidates(scene, usable, score)
        plan, est = score.best()
        current = dataclasses.replace(self.plan, poll_s=None)
        if (
            self.estimate is not None
            and current.hedge in usable
            and (current.backup is None or current.backup in seen)
            and self._close(score, current, plan)
        ):
            # plans this close differ by less than the estimate's noise: flapping between
            # them only mixes their tails
            plan, est = current, score(current)[1]
        keeping = score.best(lambda p: p.cutover_s is not None and not p.cancel_queued)[0]
        if (
            keeping.hedge is not None
            and keeping != plan
            and score(plan)[0][0] == 0
            and self._close(score, keeping, plan)
        ):
            # as good: keeping a queued primary can only make a request faster, and it shows
            # what queued jobs do now
            plan, est = keeping, score(keeping)[1]
        self.keep_plan = self._keeping(score, plan)
        if plan.cutover_s is None and (scene.exact_queue or self._queue_seen()):
            # no cutover: still read the primary's state once, so the next fit knows it
            plan = dataclasses.replace(plan, poll_s=self._scaled(DEFAULT_PLAN_TIMES)[0])
        self.plan, self.estimate = plan, est

    def _queue_seen(self) -> bool:
        return any(s.queue_lo > 0 for s in self.samples.get(self.primary, ()))

    @staticmethod
    def _close(score: _Scores, other: Plan, best: Plan) -> bool:
        """Whether ``other`` scores within ``SWITCH_MARGIN`` of ``best``."""
        mine, top = score(other)[0], score(best)[0]
        return mine[0] == top[0] and top[1] >= mine[1] * (1 - SWITCH_MARGIN)

    def _keeping(self, score: _Scores, plan: Plan) -> Plan:
        """``plan`` keeping a queued primary beside its hedge, at the same times; a backup
        cannot join beside it, so the better of its two hedges not in alarm stays."""
        if plan.cutover_s is None:
            return Plan()
        alone = dataclasses.replace(plan, cancel_queued=False, backup=None, backup_s=None)
        kept = [
            dataclasses.replace(alone, hedge=h)
            for h in (plan.hedge, plan.backup)
            if h is not None and not self.in_alarm(h)
        ]
        return score.least(kept) if kept else Plan()

    def _rank(self, est: Estimate) -> Rank:
        if est.miss_share <= MISS_SHARE:
            return (0, est.objective(self.usd_weight), est.miss_share)
        return (1, est.miss_share, est.objective(self.usd_weight))

    def _scene(self, hedges: Sequence[str]) -> Scene:
        primary = self._points(self.primary)
        exact = sorted(
            s.queue_lo
            for s in self.samples.get(self.primary, ())
            if s.queue_lo == s.queue_hi and s.queue_lo < INF
        )
        points = {h: self._points(h) for h in hedges}
        return Scene(
            self.primary,
            primary,
            exact,
            points,
            self.rates,
            self.deadline_s,
            self.cancel_latency(self.primary),
            {p: self._n_eff(p) for p in (self.primary, *hedges)},
        )

    def _n_eff(self, provider: str) -> float:
        return effective_size(self.samples.get(provider, []), HALF_LIFE)

    def _points(self, provider: str) -> list[Point]:
        # queue bounds to a tenth of a second at a 60 s deadline, finer on compressed time
        step = decimal_step(self.deadline_s / 600)
        hang_s = self._scaled((HANG_WATCH_S,))[0]
        return to_points(self.samples.get(provider, []), HALF_LIFE, step, hang_s)

    def _candidates(self, scene: Scene, usable: Sequence[str], score: _Scores) -> None:
        """Score the plans worth trying: no hedge, and per hedge and backup a descent over
        the grid's times."""
        score(Plan())
        queue_signal = bool(scene.exact_queue) or any(
            p.queue_lo > 0 or p.queue_hi < INF for p in scene.primary_points
        )
        cuts: list[float | None] = [None]
        if queue_signal:
            # just past the queue times seen, where a cutover stops catching warm jobs
            exact = scene.exact_queue
            near = [exact[int(q * (len(exact) - 1))] for q in (0.5, 0.7, 0.9)] if exact else []
            cuts += grid(
                [*self._scaled(CUTOVER_GRID), *(d * 1.1 + 0.1 for d in near)],
                self._scaled((0.1,))[0],
                scene.deadline_s / 2,
            )
        valid_primary = quantiles(scene.primary_points)
        safeties: list[float | None] = [None]
        safeties += grid(
            [
                *self._scaled(SAFETY_GRID),
                *(t * 1.1 + self._scaled((0.5,))[0] for t in valid_primary),
            ],
            self._scaled((1.0,))[0],
            scene.deadline_s,
        )
        for hedge in usable:
            valid = quantiles(scene.hedges[hedge])
            backups: list[float | None] = [None, 0.0]  # 0: both hedges at once
            backups += grid(
                [*self._scaled(BACKUP_GRID), *(t * 1.05 + self._scaled((0.5,))[0] for t in valid)],
                self._scaled((1.0,))[0],
                scene.deadline_s,
            )
            # a provider in alarm still backs up a hedge: its failures are in the estimate
            for backup in [None, *(b for b in scene.hedges if b != hedge)]:
                self._descend(score, hedge, backup, cuts, safeties, backups)

    def _descend(
        self,
        score: _Scores,
        hedge: str,
        backup: str | None,
        cuts: Sequence[float | None],
        safeties: Sequence[float | None],
        backups: Sequence[float | None],
    ) -> None:
        """Search one hedge and backup's times, one at a time (two passes)."""
        cut, safety = self._scaled(DEFAULT_PLAN_TIMES)
        plan = Plan(hedge, backup, cut if len(cuts) > 1 else None, safety, None)
        for _ in range(2):
            if backup is not None:
                plan = score.least(dataclasses.replace(plan, backup_s=b) for b in backups)
            plan = score.least(
                dataclasses.replace(plan, cutover_s=c, safety_s=s, cancel_queued=k)
                for c in cuts
                for s in safeties
                for k in ((True, False) if c is not None else (True,))
                if c is None or s is None or s >= c
            )

    def _scaled(self, times: Sequence[float]) -> list[float]:
        return [t * self.deadline_s / GRID_DEADLINE_S for t in times]

    def _affordable(self) -> float | None:
        """Launches per request the bucket can pay for over the time it takes to refill (the
        budget, plus what it holds now spread over that time)."""
        if self.budget is None:
            return None
        return self.budget * (1.0 + max(0.0, self.tokens) / CAPACITY)

    def _with_probe(self, plan: Plan) -> Plan:
        """The fitted plan, or once in a while one that watches what the plan never shows: a
        hedge not seen for long, or how a primary job a cutover would cancel really ends."""
        if plan.hedge is None:
            return plan
        for hedge in self.hedges:
            if hedge == plan.hedge or self.in_alarm(hedge):
                continue
            if not self._due(hedge, self.last_seen(hedge)):
                continue
            if plan.cutover_s is not None:
                # beside the plan's hedge when it cuts over, not instead of it: the request
                # keeps its usual latency, and a provider that got faster wins and shows it
                return dataclasses.replace(plan, backup=hedge, backup_s=0.0, cancel_queued=True)
            # the hedge joins beside a live primary, where a backup waits for a failure: the
            # probe takes the hedge's place, and the plan's hedge backs it up
            backup = plan.backup if plan.backup not in (None, hedge) else plan.hedge
            backup_s = plan.backup_s if plan.backup not in (None, hedge) else 0.0
            return dataclasses.replace(plan, hedge=hedge, backup=backup, backup_s=backup_s)
        keep = self.keep_plan
        if (
            plan.cutover_s is not None
            and plan.cancel_queued
            and keep.hedge is not None
            and not self.in_alarm(keep.hedge)
            and self.seq % PRIMARY_PROBE == 0
        ):
            # the cheapest plan that keeps a queued primary beside its hedge (a queued job
            # costs nothing, and it is cancelled when the hedge wins)
            return keep
        return plan

    def _due(self, provider: str, last: int) -> bool:
        if self.seq - last < STALE_AGE:
            return False
        if self.seq - self.probed_at.get(provider, -PROBE_GAP) < PROBE_GAP:
            return False
        self.probed_at[provider] = self.seq
        return True

    # ------------------------------------------------------------------ state
    def summary(self) -> dict[str, Any]:
        """What ``policy show`` and the metrics say: the plan, its estimate, the budget, and
        what it was learned from."""
        est = self.estimate
        return {
            "plan": self.plan.to_dict(),
            "estimate": None
            if est is None
            else {
                "p95_s": est.p95_s,
                "active_usd": est.active_usd,
                "miss_share": est.miss_share,
                "hedge_share": est.hedge_share,
                "token_share": est.token_share,
                "objective": est.objective(self.usd_weight),
            },
            "seq": self.seq,
            "fitted_at": self.fitted_at,
            "tokens": self.tokens if self.budget is not None else None,
            "races": self.races,
            "paired": self.paired,
            "samples": {p: len(kept) for p, kept in self.samples.items()},
            "alarms": {p: until for p, until in self.alarm_until.items() if until > self.seq},
            "cancel_s": {p: self.cancel_latency(p) for p in self.cancel_s},
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "primary": self.primary,
            "hedges": list(self.hedges),
            "deadline_s": self.deadline_s,
            "budget": self.budget,
            "seq": self.seq,
            "tokens": self.tokens,
            "samples": {
                p: [[s.seq, s.at, s.outcome, s.queue_lo, _finite(s.queue_hi)] for s in kept]
                for p, kept in self.samples.items()
            },
            "cancel_s": {p: [list(x) for x in kept] for p, kept in self.cancel_s.items()},
            "alarm_until": dict(self.alarm_until),
            "alarm_for": dict(self.alarm_for),
            "plan": self.plan.to_dict(),
            "keep_plan": self.keep_plan.to_dict(),
            # the switch margin compares against it: a copy without it would switch freely
            "estimate": None if self.estimate is None else dataclasses.asdict(self.estimate),
            "fitted_at": self.fitted_at,
            "races": self.races,
            "paired": self.paired,
            "probed_at": dict(self.probed_at),
            "usd_weight": self.usd_weight,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], rates: Mapping[str, ProviderRate]) -> Learner:
        samples = {
            p: [
                Sample(int(a), float(b), str(c), float(d), INF if e is None else float(e))
                for a, b, c, d, e in kept
            ]
            for p, kept in data.get("samples", {}).items()
        }
        est = data.get("estimate")
        return cls(
            primary=str(data["primary"]),
            hedges=tuple(data["hedges"]),
            deadline_s=float(data["deadline_s"]),
            budget=None if data.get("budget") is None else float(data["budget"]),
            rates=rates,
            seq=int(data.get("seq", 0)),
            tokens=float(data.get("tokens", CAPACITY)),
            samples=samples,
            cancel_s={
                p: [(int(a), float(b)) for a, b in kept]
                for p, kept in data.get("cancel_s", {}).items()
            },
            alarm_until={p: int(v) for p, v in data.get("alarm_until", {}).items()},
            alarm_for={p: int(v) for p, v in data.get("alarm_for", {}).items()},
            plan=Plan.from_dict(data.get("plan", {})),
            keep_plan=Plan.from_dict(data.get("keep_plan", {})),
            estimate=None if est is None else Estimate(**{k: float(v) for k, v in est.items()}),
            fitted_at=int(data.get("fitted_at", -1)),
            races=int(data.get("races", 0)),
            paired=int(data.get("paired", 0)),
            probed_at={p: int(v) for p, v in data.get("probed_at", {}).items()},
            usd_weight=float(data.get("usd_weight", USD_WEIGHT)),
        )


def _finite(x: float) -> float | None:
    return None if x == INF else x
