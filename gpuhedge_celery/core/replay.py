"""Offline replay: evaluate any policy on recorded paired-round traces with the real race engine.

Every round of a trace ran the same request on every provider, so the recorded per-provider
timings can be combined into any race. For each (policy, round) we run the same
:class:`~gpuhedge_celery.core.race.Race` that live races use, on a
:class:`~gpuhedge_celery.core.clock.VirtualClock`, with a driver that answers its actions from the
trace: a launched job returns its recorded result ``wall_s`` after its submit; a status poll says
QUEUED until the provider's recorded queue delay (RunPod's ``metrics.runpod_delay_ms``) and
IN_PROGRESS after it (providers without a queue signal answer UNKNOWN, the coarser truth); a cancel
is acknowledged and confirmed terminal at once, which is what "loser cancelled at the winner's
time" means in the published tables. No closed-form latency formula is used anywhere.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .adaptive import AdaptivePolicy, new_learner, observe
from .attempts import hedged
from .jobs import JobState
from .outcome import attempt_cost
from .policies import Policy, parse_policy
from .race import Race
from .rates import PUBLISHED_RATES, ProviderRate
from .scripted import Arm, run_race
from .stats import INF, Summary, summarise

SUBSETS = ("all", "calibration", "evaluation")
CALIBRATION_LAST_ROUND = 18  # rounds 1-18 calibrate, 19 onwards evaluate
DELAY_GRID_S = (0, 5, 10, 15, 20, 30, 45, 60)
DEFAULT_DEADLINES_S = (60.0,)


@dataclass(frozen=True)
class Round:
    """One paired round: the same request run on every provider."""

    round_id: int
    arms: Mapping[str, Arm]

    def subset(self, calibration: int = CALIBRATION_LAST_ROUND) -> str:
        """``calibration`` for rounds up to ``calibration``, ``evaluation`` after them."""
        return "calibration" if self.round_id <= calibration else "evaluation"


_STATES = {"COMPLETED": JobState.COMPLETED, "FAILED": JobState.FAILED, "TIMEOUT": JobState.TIMEOUT}
_STATES |= {"TIMED_OUT": JobState.TIMEOUT, "CANCELLED": JobState.CANCELLED}


def _arm(provider: str, data: Mapping[str, Any]) -> Arm:
    state_text = str(data.get("state") or "").upper()
    metrics = data.get("metrics") or {}
    delay_ms = metrics.get(f"{provider}_delay_ms", metrics.get("queue_delay_ms"))
    return Arm(
        provider=provider,
        wall_s=float(data["wall_s"]),
        valid=bool(data["valid"]),
        state=_STATES.get(state_text, JobState.FAILED),
        reasons=tuple(str(r) for r in data.get("validation_reasons") or ()),
        submitted="SUBMIT" not in state_text,
        queue_delay_s=None if delay_ms is None else float(delay_ms) / 1000.0,
    )


def parse_rounds(lines: Iterable[str], source: str = "<traces>") -> list[Round]:
    """Parse JSON lines of ``kind: round`` records; other kinds are skipped."""
    rounds = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"not JSON ({e.msg})", file=source, key=where) from None
        if not isinstance(record, dict) or record.get("kind", "round") != "round":
            continue
        try:
            arms = {p: _arm(p, d) for p, d in record["providers"].items()}
            rounds.append(Round(int(record["round_id"]), arms))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(
                f"a round needs round_id and providers with wall_s and valid ({e!r})",
                file=source,
                key=where,
            ) from None
    if not rounds:
        raise ConfigError("no round records found", file=source)
    return rounds


def load_rounds(path: str | Path) -> list[Round]:
    """Read a paired-round traces file (format: the traces README)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read traces ({e.strerror})", file=str(path)) from None
    return parse_rounds(text.splitlines(), str(path))


def select(
    rounds: Sequence[Round], subset: str, calibration: int = CALIBRATION_LAST_ROUND
) -> list[Round]:
    """The rounds of ``subset`` (all, calibration, evaluation)."""
    if subset not in SUBSETS:
        raise ConfigError(f"unknown subset {subset!r}: expected one of {', '.join(SUBSETS)}")
    return [r for r in rounds if subset == "all" or r.subset(calibration) == subset]


@dataclass(frozen=True)
class RoundResult:
    """One policy on one round: latency (inf when no valid result), cost and whether it hedged."""

    round_id: int
    latency_s: float
    active_usd: float
    billed_usd: float
    hedged: bool
    race: Race


def replay_round(
    policy: Policy,
    rnd: Round,
    rates: Mapping[str, ProviderRate] | None = None,
) -> RoundResult:
    """Run ``policy``'s race on ``rnd``'s recorded timings on a virtual clock, and price it."""
    return _priced(run_race(policy, rnd.arms, race_id=f"round-{rnd.round_id}"), rnd, rates)


def _priced(race: Race, rnd: Round, rates: Mapping[str, ProviderRate] | None) -> RoundResult:
    rates = PUBLISHED_RATES if rates is None else rates
    active = billed = 0.0
    for attempt in race.attempts:
        rate = rates.get(attempt.provider)
        if rate is None:
            raise ConfigError(f"no rate for provider {attempt.provider!r}", key="rates")
        cost = attempt_cost(attempt, rate)
        active += cost.active_usd
        billed += cost.billed_usd
    latency = race.latency()
    return RoundResult(
        round_id=rnd.round_id,
        latency_s=INF if latency is None else latency,
        active_usd=active,
        billed_usd=billed,
        hedged=hedged(race.attempts),
        race=race,
    )


def replay_policy(
    policy: Policy,
    rounds: Sequence[Round],
    rates: Mapping[str, ProviderRate] | None = None,
    calibration: int = CALIBRATION_LAST_ROUND,
) -> list[RoundResult]:
    """``replay_round`` over every round, in order; an adaptive policy learns as it goes."""
    if isinstance(policy, AdaptivePolicy):
        return replay_adaptive(policy, rounds, rates, calibration)
    return [replay_round(policy, r, rates) for r in rounds]


def replay_adaptive(
    policy: AdaptivePolicy,
    rounds: Sequence[Round],
    rates: Mapping[str, ProviderRate] | None = None,
    calibration: int = CALIBRATION_LAST_ROUND,
) -> list[RoundResult]:
    """An adaptive policy over the rounds in ``round_id`` order, with an honest split.

    It starts knowing nothing. After each calibration round it learns every provider's
    recorded outcome (those rounds are paired); after each evaluation round only what its own
    race observed. Each round's plan is made before its race runs, from earlier rounds only.
    """
    learner = new_learner(policy, rates)
    own = AdaptivePolicy(**policy.params()).use(learner)
    results = []
    for rnd in sorted(rounds, key=lambda r: r.round_id):
        race = run_race(own, rnd.arms, race_id=f"round-{rnd.round_id}")
        seq = int(race.state["seq"])
        if rnd.round_id <= calibration:
            arms = {p: (a.wall_s, a.valid, a.queue_delay_s) for p, a in rnd.arms.items()}
            learner.feed_paired(seq, arms)
        else:
            learner.feed(observe(seq, race.attempts, race.clock.now()))
        results.append(_priced(race, rnd, rates))
    return results


def summarise_results(
    results: Sequence[RoundResult], deadlines: Sequence[float] = DEFAULT_DEADLINES_S
) -> Summary:
    """The table row for a list of per-round results."""
    return summarise(
        [r.latency_s for r in results],
        [r.active_usd for r in results],
        [r.billed_usd for r in results],
        [r.hedged for r in results],
        deadlines,
    )


def providers_of(rounds: Sequence[Round]) -> list[str]:
    """Providers present in the traces, in first-seen order."""
    seen: dict[str, None] = {}
    for r in rounds:
        for p in r.arms:
            seen.setdefault(p)
    return list(seen)


def queue_signal_providers(rounds: Sequence[Round]) -> list[str]:
    """Providers whose traces record a queue delay (so a cutover can read their state)."""
    return [
        p
        for p in providers_of(rounds)
        if any(p in r.arms and r.arms[p].queue_delay_s is not None for r in rounds)
    ]


def default_policies(rounds: Sequence[Round]) -> list[tuple[str, Policy]]:
    """The default sweep as (family, policy): singles, immediate races, fixed hedges over the
    delay grid, and cutovers and cascades from every provider with a queue signal."""
    names = providers_of(rounds)
    pairs = [(p, h) for p in names for h in names if p != h]
    out: list[tuple[str, Policy]] = [("single", parse_policy(f"single:{p}")) for p in names]
    out += [("race", parse_policy(f"hedge:{p}->{h}@0s")) for p, h in pairs]
    out += [
        ("fixed", parse_policy(f"hedge:{p}->{h}@{d}s")) for p, h in pairs for d in DELAY_GRID_S if d
    ]
    signal = queue_signal_providers(rounds)
    out += [("cutover", parse_policy(f"cutover:{p}->{h}")) for p, h in pairs if p in signal]
    out += [
        ("cascade", parse_policy(f"cascade:{p}->{h}->{f}"))
        for p, h in pairs
        if p in signal
        for f in names
        if f not in (p, h)
    ]
    return out


def row(
    policy: Policy, subset: str, summary: Summary, deadlines: Sequence[float]
) -> dict[str, Any]:
    """One ``--json`` object; keys exactly as documented (deadline keys as plain strings)."""

    def key(d: float) -> str:
        return f"{d:g}"

    def num(v: float) -> float | None:
        return None if math.isinf(v) else v

    return {
        "policy": policy.name,
        "subset": subset,
        "n": summary.n,
        "p50_s": num(summary.p50_s),
        "p95_s": num(summary.p95_s),
        "p95_linear_s": num(summary.p95_linear_s),
        "max_s": num(summary.max_s),
        "misses": {key(d): summary.misses[float(d)] for d in deadlines},
        "miss_ci": {key(d): list(summary.miss_ci[float(d)]) for d in deadlines},
        "active_usd": summary.active_usd,
        "billed_usd": summary.billed_usd,
        "hedged": summary.hedged,
        "hedge_rate": summary.hedge_rate,
    }


def sweep(
    rounds: Sequence[Round],
    policies: Sequence[Policy],
    subsets: Sequence[str] = SUBSETS,
    deadlines: Sequence[float] = DEFAULT_DEADLINES_S,
    rates: Mapping[str, ProviderRate] | None = None,
    calibration: int = CALIBRATION_LAST_ROUND,
) -> list[dict[str, Any]]:
    """Rows for every policy and subset. Each race runs once; subsets reuse its result."""
    rows = []
    for policy in policies:
        results = replay_policy(policy, rounds, rates, calibration)
        for subset in subsets:
            wanted = {r.round_id for r in select(rounds, subset, calibration)}
            chosen = [r for r in results if r.round_id in wanted]
            if chosen:
                rows.append(row(policy, subset, summarise_results(chosen, deadlines), deadlines))
    return rows


def provider_table(rounds: Sequence[Round]) -> list[dict[str, Any]]:
    """Per provider over the given rounds: valid count and p50/p95/max of the finite values."""
    from .stats import nearest_rank

    table = []
    for p in providers_of(rounds):
        walls = [r.arms[p].wall_s for r in rounds if p in r.arms and r.arms[p].valid]
        entry: dict[str, Any] = {"provider": p, "rounds": sum(1 for r in rounds if p in r.arms)}
        entry["valid"] = len(walls)
        entry["p50_s"] = nearest_rank(walls, 0.5) if walls else None
        entry["p95_s"] = nearest_rank(walls, 0.95) if walls else None
        entry["max_s"] = max(walls) if walls else None
        delays = [r.arms[p].queue_delay_s for r in rounds if p in r.arms]
        known = [d for d in delays if d is not None]
        entry["queue_delay_s"] = [min(known), max(known)] if known else None
        table.append(entry)
    return table
