"""How an adaptive policy scores a plan: estimated p95 and cost from per-provider samples.

A plan says, for one request, which hedge to use (and a backup behind it), when to poll the
primary and cut over if it is still queued, when to hedge beside a primary that runs but has no
result, and when the backup joins. Its score is the objective an operator states:
``J = p95 seconds + 1000 x active USD per request`` (one cent is worth 10 s of p95), among plans
whose estimated share of requests over the deadline is at most 5 %.

Providers are modelled one by one (a sample is one job: when it ended, whether its result was
valid, or that it was still running when the race stopped watching it), because a live race
observes only the jobs it launched; the joint timing of two providers on one request is never
seen again after calibration. A sample still running when it was cancelled is only known to take
longer: its weight moves to the samples that ended later (Efron's redistribute-to-the-right,
which is the Kaplan-Meier estimate). Older samples weigh less (a half-life in requests), so a
provider that changes is followed.

The estimate walks the race the engine would run (the same rules: a valid result wins, at most
two live jobs, a failed hedge brings the backup at once) over the weighted samples, assuming the
providers independent. Its p95 is the mean of the quantiles at the levels within one standard
error of 95 % (the error of a 5 % share measured on as many jobs as the plan's providers'
samples are effectively worth): a tail seen in a few jobs is neither a cliff nor nothing, so a
plan whose tail sits just under 5 % pays for part of it, and insurance against it earns part of
its worth. Pure: no clock, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .rates import ProviderRate

INF = math.inf
USD_WEIGHT = 1000.0  # seconds of p95 one dollar per request is worth (provider time)
MISS_SHARE = 0.05  # a plan may miss the deadline on at most this share of requests
_MERGE = 0.02  # samples within 2 % of each other are one point of the estimate
MAX_POINTS = 64  # points per provider at most (the estimate walks each)
OPTIMISM = 3  # jobs never seen to end that still count as "valid soon" (see _ended)


@dataclass(frozen=True)
class Sample:
    """One job of one provider; times in seconds since its submit.

    ``outcome``: ``valid``, ``invalid`` (ended without a valid result) or ``censored`` (still
    running when the race stopped watching it at ``at``). ``queue_lo``/``queue_hi`` bound how
    long it sat queued, from poll answers (exact when both are equal).
    """

    seq: int
    at: float
    outcome: str
    queue_lo: float = 0.0
    queue_hi: float = INF


@dataclass(frozen=True)
class Point:
    """A weighted outcome of one provider's job: it ended at ``at``, valid or not."""

    at: float
    ok: bool
    weight: float
    queue_lo: float = 0.0
    queue_hi: float = INF


@dataclass(frozen=True)
class Plan:
    """One request's hedging plan (seconds; ``None``: never)."""

    hedge: str | None = None
    backup: str | None = None
    cutover_s: float | None = None  # poll the primary; still queued -> cancel it, hedge
    safety_s: float | None = None  # no result yet -> hedge beside the running primary
    backup_s: float | None = None  # after the hedge's launch: the backup joins
    cancel_queued: bool = True  # False: a primary still queued keeps its place beside the hedge
    poll_s: float | None = None  # without a cutover: poll the primary then anyway, to learn

    def to_dict(self) -> dict[str, object]:
        return {
            "hedge": self.hedge,
            "backup": self.backup,
            "cutover_s": self.cutover_s,
            "safety_s": self.safety_s,
            "backup_s": self.backup_s,
            "cancel_queued": self.cancel_queued,
            "poll_s": self.poll_s,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Plan:
        def num(key: str) -> float | None:
            value = data.get(key)
            return None if value is None else float(value)  # type: ignore[arg-type]

        def text(key: str) -> str | None:
            value = data.get(key)
            return None if value is None else str(value)

        return cls(
            text("hedge"),
            text("backup"),
            num("cutover_s"),
            num("safety_s"),
            num("backup_s"),
            bool(data.get("cancel_queued", True)),
            num("poll_s"),
        )


@dataclass(frozen=True)
class Estimate:
    """What a plan is expected to give per request."""

    p95_s: float
    active_usd: float
    miss_share: float
    hedge_share: float
    token_share: float = 0.0  # hedge and backup launches per request (what a budget counts)

    def objective(self, usd_weight: float = USD_WEIGHT) -> float:
        """p95 plus ``usd_weight`` seconds per dollar (scaled by a fleet's ``time_scale``:
        its p95 is in real seconds, its dollars in provider time)."""
        return self.p95_s + usd_weight * self.active_usd


def weights(n: int, half_life: float) -> list[float]:
    """The weight of each of ``n`` samples of one provider, oldest first: halved for every
    ``half_life`` newer samples."""
    return [0.5 ** ((n - 1 - i) / half_life) for i in range(n)]


def _masses(samples: Sequence[Sample], half_life: float) -> tuple[list[Sample], list[float]]:
    """The samples by end time and their weights once each censored job's weight went to the
    jobs seen to end later (a job cancelled while queued: to jobs that could have queued that
    long), in proportion to their own weights: the recent jobs that ran that long say what a
    job cut short now would have done."""
    ordered = sorted(zip(samples, weights(len(samples), half_life), strict=True), key=_at)
    jobs = [sample for sample, _ in ordered]
    memory = [w for _, w in ordered]
    mass = list(memory)
    for i, sample in enumerate(jobs):
        if sample.outcome != "censored":
            continue
        later = [
            j
            for j in range(i + 1, len(jobs))
            if jobs[j].outcome != "censored" and jobs[j].queue_hi > sample.queue_lo
        ]
        total = sum(memory[j] for j in later)
        if total > 0:
            for j in later:
                mass[j] += mass[i] * memory[j] / total
            mass[i] = 0.0
    return jobs, mass


def _at(pair: tuple[Sample, float]) -> float:
    return pair[0].at


def effective_size(samples: Sequence[Sample], half_life: float) -> float:
    """How many equally weighted jobs the weighted outcome distribution is worth (Kish's
    effective sample size): lower when censored jobs' weight piled onto a few seen to end,
    as it does in a tail watched rarely."""
    mass = _masses(samples, half_life)[1]
    square = sum(m * m for m in mass)
    return sum(mass) ** 2 / square if square > 0 else 0.0


def points(
    samples: Sequence[Sample], half_life: float, resolution: float = 0.1, hang_s: float = 0.0
) -> list[Point]:
    """The weighted outcome distribution of one provider, censored samples redistributed
    (:func:`_masses`). Only jobs watched at least ``hang_s`` count as possibly hung (see
    :func:`_ended`): a job stopped sooner, because a faster one won, says nothing about
    whether it would answer.
    """
    jobs, mass = _masses(samples, half_life)
    leftover = sum(
        1
        for s, m in zip(jobs, mass, strict=True)
        if m > 0 and s.outcome == "censored" and s.at >= hang_s
    )
    hopeful = leftover <= OPTIMISM  # past that, jobs never seen to end count as never answering
    out = [
        Point(
            *_ended(s, hopeful or s.at < hang_s),
            m,
            _bound(s.queue_lo, resolution),
            _bound(s.queue_hi, resolution),
        )
        for s, m in zip(jobs, mass, strict=True)
        if m > 0
    ]
    total = sum(p.weight for p in out)
    merged = _merge([Point(p.at, p.ok, p.weight / total, p.queue_lo, p.queue_hi) for p in out])
    return merged if len(merged) <= MAX_POINTS else _compress(merged)


def _ended(s: Sample, hopeful: bool) -> tuple[float, bool]:
    """When and how a sample ended. A censored one that nothing was seen to outlast is valid at
    twice its bound while a provider has at most ``OPTIMISM`` of them watched long enough to
    hang: optimism about the unknown, so the plan tries the provider and learns (a pessimistic
    guess would never launch it again). Past that it never answered."""
    if s.outcome == "censored":
        return (2 * s.at, True) if hopeful else (s.at, False)
    return s.at, s.outcome == "valid"


def decimal_step(x: float) -> float:
    """The power of ten at or below ``x`` (so decimal times stay exact on the grid)."""
    return 10.0 ** math.floor(math.log10(x))


def _bound(x: float, resolution: float) -> float:
    """A queue bound to the ``resolution`` below (``lo`` errs early, which a cutover poll's own
    time already is): jobs whose bounds round alike are one point of the estimate."""
    return x if math.isinf(x) else round(math.floor(x / resolution + 1e-9) * resolution, 12)


def _compress(pts: list[Point]) -> list[Point]:
    """At most ``MAX_POINTS`` points: neighbours by queue time, then by end, become one (a live
    primary's poll answers give nearly every job its own bounds; the fit's cost follows)."""
    out: list[Point] = []
    for ok in (True, False):
        group = sorted((p for p in pts if p.ok == ok), key=lambda q: (q.queue_lo, q.at))
        if not group:
            continue
        size = math.ceil(len(group) / max(1, MAX_POINTS * len(group) // len(pts)))
        for i in range(0, len(group), size):
            chunk = group[i : i + size]
            w = sum(p.weight for p in chunk)
            his = [p.queue_hi for p in chunk]
            hi = (
                INF
                if any(math.isinf(h) for h in his)
                else sum(p.queue_hi * p.weight for p in chunk) / w
            )
            out.append(
                Point(
                    sum(p.at * p.weight for p in chunk) / w,
                    ok,
                    w,
                    sum(p.queue_lo * p.weight for p in chunk) / w,
                    hi,
                )
            )
    return out


def _merge(pts: list[Point]) -> list[Point]:
    """Points of the same outcome within 2 % of each other become one (the estimate's cost)."""
    merged: list[Point] = []
    for p in sorted(pts, key=lambda q: (q.ok, q.queue_lo, q.queue_hi, q.at)):
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.ok == p.ok
            and p.at <= last.at * (1 + _MERGE) + 1e-9
            and (last.queue_lo, last.queue_hi) == (p.queue_lo, p.queue_hi)
        ):
            w = last.weight + p.weight
            at = (last.at * last.weight + p.at * p.weight) / w
            merged[-1] = Point(at, p.ok, w, p.queue_lo, p.queue_hi)
        else:
            merged.append(p)
    return merged


def queued_share(p: Point, at: float, exact: Sequence[float]) -> float:
    """How likely a primary job of point ``p`` is still queued ``at`` seconds after its submit.

    Bounds from polls decide when they can; between them, the exactly known queue delays of
    other jobs in that interval (``exact``, sorted) say how the time splits (uniform when there
    are none).
    """
    if p.queue_lo >= at:
        return 1.0 if p.queue_lo > at or p.queue_hi > at else 0.0
    hi = min(p.queue_hi, p.at)
    if hi <= at:
        return 0.0
    first, last = bisect_left(exact, p.queue_lo), bisect_right(exact, hi)
    if last > first:
        return (last - bisect_right(exact, at, first, last)) / (last - first)
    if math.isinf(hi):
        return 0.5
    return (hi - at) / (hi - p.queue_lo)


@dataclass(frozen=True)
class HedgeLeg:
    """The outcome of a hedge (and its backup) from the hedge's launch: when a valid result is
    in (``INF``: none), and the active seconds each provider ran."""

    after: float
    hedge_s: float
    backup_s: float
    weight: float
    backups: float = 0.0  # the share of these outcomes in which the backup was launched


def hedge_legs(
    hedge: Sequence[Point], backup: Sequence[Point] | None, backup_after: float | None
) -> list[HedgeLeg]:
    """Every way the hedge (and the backup joining ``backup_after`` later, or when the hedge
    fails) can go, weighted."""
    legs: list[HedgeLeg] = []
    for h in hedge:
        joins = h.at if not h.ok else INF
        if backup_after is not None:
            joins = min(joins, backup_after)
        if backup is None or math.isinf(joins) or (h.ok and h.at <= joins):
            done = h.at if h.ok else INF
            legs.append(HedgeLeg(done, h.at, 0.0, h.weight))
            continue
        for b in backup:
            first = min(h.at if h.ok else INF, joins + b.at if b.ok else INF)
            hedge_ran = min(h.at, first)
            backup_ran = min(b.at, first - joins) if not math.isinf(first) else b.at
            legs.append(HedgeLeg(first, hedge_ran, backup_ran, h.weight * b.weight, 1.0))
    return legs


def _quantile(
    ranked: Sequence[tuple[float, float]],
    total: float,
    q: float,
    spread: float = 0.0,
    cap: float = INF,
) -> float:
    """The ``q`` quantile of weighted outcomes sorted by value; with ``spread``, the mean of
    the quantiles from ``q - spread`` to ``q + spread`` (a result never in counts as ``cap``).
    Walks down from the top, where the levels of interest are."""
    lo, hi = (q - spread) * total, min(1.0, q + spread) * total
    run = total  # the weight at or below the current outcome
    acc = 0.0
    for x, w in reversed(ranked):
        below = run - w
        if spread <= 0:
            if below < lo - 1e-12:
                return x
        else:
            a, b = max(below, lo), min(run, hi)
            if b > a:
                acc += (b - a) * min(x, cap)
            if below <= lo:
                break
        run = below
    if spread <= 0:
        return ranked[0][0] if ranked else INF
    return acc / (hi - lo)


@dataclass(frozen=True)
class Scene:
    """What the estimate of every plan reads: the samples as points, the rates, the deadline."""

    primary: str
    primary_points: Sequence[Point]
    exact_queue: Sequence[float]
    hedges: Mapping[str, Sequence[Point]]
    rates: Mapping[str, ProviderRate]
    deadline_s: float
    cancel_s: float = 0.0  # how long a cancel of the primary takes to land
    n_eff: Mapping[str, float] = field(default_factory=dict)  # provider -> effective jobs
    cache: dict[tuple[str | None, str | None, float | None], tuple[list[HedgeLeg], float]] = field(
        default_factory=dict
    )


def _legs(scene: Scene, plan: Plan) -> tuple[list[HedgeLeg], float]:
    """The plan's hedge legs (equal outcomes merged) and their expected USD, cached per scene."""
    key = (plan.hedge, plan.backup, plan.backup_s)
    cached = scene.cache.get(key)
    if cached is not None:
        return cached
    assert plan.hedge is not None
    backup = scene.hedges[plan.backup] if plan.backup is not None else None
    rate_h = scene.rates[plan.hedge].rate_per_s
    rate_b = scene.rates[plan.backup].rate_per_s if plan.backup is not None else 0.0
    merged: dict[float, list[float]] = {}
    step = decimal_step(scene.deadline_s * 1e-4)  # a thousandth of a second at a 60 s deadline
    usd = 0.0
    for g in hedge_legs(scene.hedges[plan.hedge], backup, plan.backup_s):
        usd += g.weight * (g.hedge_s * rate_h + g.backup_s * rate_b)
        at = g.after if math.isinf(g.after) else round(g.after / step)
        slot = merged.setdefault(at, [0.0, 0.0, 0.0, 0.0])
        slot[0] += g.weight
        slot[1] += g.weight * g.hedge_s
        slot[2] += g.weight * g.backup_s
        slot[3] += g.weight * g.backups
    legs = [
        HedgeLeg(round(at * step, 12), h / w, b / w, w, n / w)
        for at, (w, h, b, n) in merged.items()
        if w > 0
    ]
    scene.cache[key] = (legs, usd)
    return legs, usd


def estimate(scene: Scene, plan: Plan, budget: float | None = None) -> Estimate:
    """The plan's expected p95, active USD, share over the deadline and share hedged.

    With a hedge ``budget`` (hedges per request) below the plan's share hedged, the bucket
    refuses the rest: that part of the requests runs the primary alone.
    """
    full = _estimate(scene, plan, 1.0)
    if budget is None or plan.hedge is None or full[4] <= budget:
        return _summary(full, scene, plan)
    allowed = budget / full[4]
    hedged_part = _estimate(scene, plan, allowed)
    alone = _estimate(scene, Plan(), 1.0 - allowed)
    both = (
        hedged_part[0] + alone[0],
        hedged_part[1] + alone[1],
        hedged_part[2] + alone[2],
        hedged_part[3] + alone[3],
        hedged_part[4] + alone[4],
    )
    return _summary(both, scene, plan)


# outcomes, usd, weight, requests hedged, tokens (hedges and backups launched)
Outcomes = tuple[list[tuple[float, float]], float, float, float, float]


def _summary(found: Outcomes, scene: Scene, plan: Plan) -> Estimate:
    outcomes, usd, total, hedged, tokens = found
    outcomes.sort()
    late = bisect_right(outcomes, (scene.deadline_s, INF))
    miss = sum(w for _, w in outcomes[late:]) / total
    n = sum(scene.n_eff.values())
    # one standard error of a 5 % share over every job the scene rests on, the same for every
    # plan: counting only the providers a plan names would favour naming more
    spread = math.sqrt(0.05 * 0.95 / max(1.0, n)) if scene.n_eff else 0.0
    p95 = _quantile(outcomes, total, 0.95, spread, 2 * scene.deadline_s)
    return Estimate(p95, usd / total, miss, hedged / total, tokens / total)


def _alone(plan: Plan) -> Plan:
    return dataclasses.replace(plan, backup=None, backup_s=None)


def _estimate(scene: Scene, plan: Plan, share: float) -> Outcomes:
    """Every request's outcome under ``plan``, weighted, scaled by ``share`` of the requests."""
    rate_p = scene.rates[scene.primary].rate_per_s
    legs: list[HedgeLeg] = []
    leg_usd = rate_h = 0.0
    if plan.hedge is not None:
        legs, leg_usd = _legs(scene, plan)
        rate_h = scene.rates[plan.hedge].rate_per_s
    outcomes: list[tuple[float, float]] = []
    starts: dict[float, float] = {}  # the hedge's launch time -> weight (legs added once each)
    usd = hedged = 0.0
    cut = plan.cutover_s if plan.hedge is not None else None
    safety = plan.safety_s if plan.hedge is not None else None

    # beside a live primary the backup cannot join (two live jobs): the hedge's legs alone
    side = [(g.after, g.hedge_s, g.weight) for g in _legs(scene, _alone(plan))[0]] if legs else []
    add = outcomes.append

    def beside(t: float, p: Point, w: float) -> None:
        # the hedge joins the primary at t; the first valid result wins (the hot loop of a fit)
        nonlocal usd, hedged
        hedged += w
        p_at, p_end = p.at, (p.at if p.ok else INF)
        spent = 0.0
        for after, hedge_s, weight in side:
            first = t + after
            if p_end < first:
                first = p_end
            if first == INF:
                spent += weight * (p_at * rate_p + hedge_s * rate_h)
            else:
                ran = first - t
                spent += weight * (
                    (p_at if p_at < first else first) * rate_p
                    + (hedge_s if hedge_s < ran else ran) * rate_h
                )
            add((first, w * weight))
        usd += w * spent

    for p in scene.primary_points:
        w = p.weight * share
        if cut is not None and p.at > cut:
            q = queued_share(p, cut, scene.exact_queue)
            if q > 0 and not plan.cancel_queued:
                beside(cut, p, w * q)
                w *= 1 - q
            elif q > 0:
                if scene.cancel_s > 0:  # a slow cancel lets a job that starts meanwhile run
                    ran = max(0.0, min(p.at, cut + scene.cancel_s) - max(p.queue_lo, cut))
                    usd += w * q * ran * rate_p
                starts[cut] = starts.get(cut, 0.0) + w * q
                w *= 1 - q
            if w <= 0:
                continue
        if not p.ok and (safety is None or p.at <= safety):
            usd += w * p.at * rate_p
            if plan.hedge is None:
                outcomes.append((INF, w))
            else:
                starts[p.at] = starts.get(p.at, 0.0) + w  # the primary failed: hedge at once
        elif safety is None or p.at <= safety:
            usd += w * p.at * rate_p
            outcomes.append((p.at, w))
        else:
            beside(safety, p, w)
    backups = sum(g.weight * g.backups for g in legs)
    for t, w in starts.items():
        hedged += w
        usd += w * leg_usd
        outcomes.extend((t + g.after, w * g.weight) for g in legs)
    tokens = hedged + backups * sum(starts.values())  # beside a live primary no backup joins
    return outcomes, usd, share, hedged, tokens  # the weights add up to share


def grid(values: Iterable[float], lo: float, hi: float) -> list[float]:
    """Distinct candidate times within [lo, hi], to two significant digits."""
    return sorted({float(f"{v:.2g}") for v in values if lo <= v <= hi})


def quantiles(
    pts: Sequence[Point], qs: Sequence[float] = (0.25, 0.5, 0.75, 0.9, 0.95)
) -> list[float]:
    """Weighted quantiles of the valid points' times (none when no point is valid)."""
    valid = sorted((p.at, p.weight) for p in pts if p.ok)
    total = sum(w for _, w in valid)
    out = []
    for q in qs:
        run = 0.0
        for at, w in valid:
            run += w
            if run >= q * total - 1e-12:
                out.append(at)
                break
    return out
