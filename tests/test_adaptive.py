"""The adaptive policy: its name, the engine's rules, an estimate that follows the engine, a
budget that holds, and a replay that never uses what a race could not have observed."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from gpuhedge_celery.core.adaptive import BUDGET_EMPTY, AdaptivePolicy, new_learner, observe
from gpuhedge_celery.core.adaptive_fit import Plan, Point, Scene, estimate
from gpuhedge_celery.core.adaptive_learn import PRIMARY_PROBE, Learner
from gpuhedge_celery.core.policies import parse_policy, policy_from_dict
from gpuhedge_celery.core.race import Race
from gpuhedge_celery.core.rates import PUBLISHED_RATES
from gpuhedge_celery.core.replay import Round, load_rounds, replay_adaptive
from gpuhedge_celery.core.scripted import Arm, run_race
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.providers.sim_traces import synth_rounds

MOSS = Path(__file__).parent / "data" / "moss_rounds.jsonl"
NAME = "adaptive:runpod->cerebrium,modal"


# ---------------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        (NAME, "adaptive:runpod->cerebrium,modal@d60s"),
        ("adaptive:runpod->cerebrium@d45s", "adaptive:runpod->cerebrium@d45s"),
        ("adaptive:a->b,c@b0.2", "adaptive:a->b,c@d60s+b0.2"),
        ("adaptive:a->b@b0.5+d30.5s", "adaptive:a->b@d30.5s+b0.5"),
    ],
)
def test_names_parse_and_round_trip(text: str, canonical: str) -> None:
    policy = parse_policy(text)
    assert isinstance(policy, AdaptivePolicy)
    assert policy.name == canonical
    assert parse_policy(policy.name) == policy
    assert policy_from_dict(policy.to_dict()) == policy


@pytest.mark.parametrize(
    "text",
    [
        "adaptive:runpod",
        "adaptive:runpod->runpod",
        "adaptive:a->b,b",
        "adaptive:a->b@x5",
        "adaptive:a->b@d0s",
        "adaptive:a->b@b11",
        "adaptive:a->b@d5",
    ],
)
def test_bad_names_are_one_line_errors(text: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_policy(text)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------- the engine's rules


def _own(name: str = NAME, rates: dict | None = None) -> tuple[AdaptivePolicy, Learner]:
    policy = parse_policy(name)
    assert isinstance(policy, AdaptivePolicy)
    learner = new_learner(policy, rates)
    return AdaptivePolicy(**policy.params()).use(learner), learner


def _feed(learner: Learner, rnd: Round, race: Race, calibration: int) -> None:
    seq = int(race.state["seq"])
    if rnd.round_id <= calibration:
        learner.feed_paired(
            seq, {p: (a.wall_s, a.valid, a.queue_delay_s) for p, a in rnd.arms.items()}
        )
    else:
        learner.feed(observe(seq, race.attempts, race.clock.now()))


def test_every_race_keeps_the_engines_rules() -> None:
    own, learner = _own()
    live_seen = []

    def check(race: Race) -> None:
        live_seen.append(race.live_count)
        assert race.live_count <= 2

    for rnd in load_rounds(MOSS):
        race = run_race(own, rnd.arms, after_event=check)
        assert race.finished
        for a in race.attempts:
            assert not a.live
            if a.id != race.winner and a.submitted_at is not None and a.result_at is None:
                assert a.receipt is not None  # every loser still running was cancelled
        _feed(learner, rnd, race, 18)
    assert max(live_seen) == 2  # it did hedge beside a running job at least once


def test_a_resumed_race_plays_the_plan_it_started_with() -> None:
    own, learner = _own()
    for rnd in load_rounds(MOSS)[:20]:
        _feed(learner, rnd, run_race(own, rnd.arms), 18)
    race = run_race(own, load_rounds(MOSS)[20].arms)
    plan = race.state["plan"]
    rebuilt = Race.from_dict(race.to_dict(), race.clock)
    assert rebuilt.state["plan"] == plan
    assert Plan.from_dict(plan).to_dict() == plan


# ------------------------------------------------------------ the estimate follows the engine


def _arms(primary: tuple[float, float], hedge: float, backup: float, valid: bool = True) -> dict:
    wall, queue = primary
    return {
        "p": Arm("p", wall, queue_delay_s=queue),
        "h": Arm("h", hedge, valid=valid),
        "b": Arm("b", backup),
    }


@pytest.mark.parametrize(
    ("primary", "hedge", "valid", "plan"),
    [
        ((100.0, 10.0), 19.0, True, Plan("h", None, 2.0, None, None)),  # cut over
        ((100.0, 10.0), 19.0, True, Plan("h", None, 2.0, None, None, cancel_queued=False)),
        ((12.0, 10.0), 19.0, True, Plan("h", None, 2.0, None, None, cancel_queued=False)),
        ((6.0, 1.0), 19.0, True, Plan("h", None, 2.0, 8.5, None)),  # warm: runs alone
        ((40.0, 1.0), 19.0, True, Plan("h", None, 2.0, 8.5, None)),  # safety hedge wins
        ((100.0, 10.0), 19.0, False, Plan("h", "b", 2.0, None, 30.0)),  # hedge fails: backup
        ((100.0, 10.0), 50.0, True, Plan("h", "b", 2.0, None, 10.0)),  # the backup joins
        ((100.0, 10.0), 19.0, True, Plan()),  # no hedge
    ],
)
def test_the_estimate_of_one_known_outcome_is_the_engines_latency_and_cost(
    primary: tuple[float, float], hedge: float, valid: bool, plan: Plan
) -> None:
    arms = _arms(primary, hedge, 30.0, valid)
    rates = {p: PUBLISHED_RATES["runpod"] for p in "phb"}
    policy = AdaptivePolicy("p", ("h", "b"))
    learner = Learner("p", ("h", "b"), 60.0, rates=rates, plan=plan, fitted_at=0)
    race = run_race(policy.use(learner), arms)
    engine_latency = race.latency()
    active = 0.0
    from gpuhedge_celery.core.outcome import attempt_cost

    for a in race.attempts:
        active += attempt_cost(a, rates[a.provider]).active_usd
    scene = Scene(
        "p",
        [Point(primary[0], True, 1.0, primary[1], primary[1])],
        [primary[1]],
        {"h": [Point(hedge, valid, 1.0)], "b": [Point(30.0, True, 1.0)]},
        rates,
        60.0,
    )
    est = estimate(scene, plan)
    assert est.p95_s == pytest.approx(
        engine_latency if engine_latency is not None else float("inf")
    )
    assert est.active_usd == pytest.approx(active, rel=1e-6, abs=1e-12)


# --------------------------------------------------------------------------------- budget


def _spec(rounds: int = 160) -> dict:
    return {
        "rounds": rounds,
        "seed": 3,
        "providers": {
            "runpod": {
                "slow_probability": 0.3,
                "fast": {"queue_s": [1.1, 1.3], "run_s": [4.4, 5.4]},
                "slow": {"queue_s": [9, 27], "run_s": [80, 95]},
            },
            "cerebrium": {
                "queue_signal": False,
                "slow_probability": 0.1,
                "fast": {"queue_s": [0.3, 0.8], "run_s": [17.5, 19.7]},
                "slow": {"queue_s": [76, 84], "run_s": [18, 20]},
            },
            "modal": {
                "queue_signal": False,
                "slow_probability": 0.12,
                "fast": {"queue_s": [0.5, 2.0], "run_s": [26, 43]},
                "slow": {"queue_s": [50, 65], "run_s": [30, 45]},
            },
        },
    }


def _rounds(spec: dict) -> list[Round]:
    import json

    from gpuhedge_celery.core.replay import parse_rounds

    return parse_rounds([json.dumps(r) for r in synth_rounds(spec)])


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.05, 0.2])
def test_a_hedge_budget_bounds_second_jobs(budget: float) -> None:
    rounds = _rounds(_spec())
    results = replay_adaptive(parse_policy(f"{NAME}@b{budget}"), rounds, calibration=40)  # type: ignore[arg-type]
    hedged = sum(r.hedged for r in results)
    assert hedged <= budget * len(results) + 10
    unbounded = replay_adaptive(parse_policy(NAME), rounds, calibration=40)  # type: ignore[arg-type]
    assert sum(r.hedged for r in unbounded) > budget * len(results) + 10  # the budget bit


def test_without_a_token_the_primary_runs_alone_and_the_race_says_so() -> None:
    policy = AdaptivePolicy("p", ("h",), budget=0.0)
    learner = Learner("p", ("h",), 60.0, budget=0.0, rates=PUBLISHED_RATES, tokens=0.0)
    learner.plan, learner.fitted_at = Plan("h", None, 2.0, None, None), 0
    arms = {"p": Arm("p", 100.0, queue_delay_s=10.0), "h": Arm("h", 19.0)}
    race = run_race(policy.use(learner), arms)
    assert BUDGET_EMPTY in race.flags
    assert [a.provider for a in race.attempts] == ["p"]
    assert race.latency() == pytest.approx(100.0)  # not cut over: nothing would replace it
    learner.tokens = 1.0
    race = run_race(policy, arms)
    assert BUDGET_EMPTY not in race.flags and race.latency() == pytest.approx(21.0)
    assert learner.tokens == 0.0


# ------------------------------------------------------------------------------- honesty


def _decisions(rounds: list[Round], calibration: int) -> list[tuple[int, dict, float]]:
    results = replay_adaptive(parse_policy(NAME), rounds, calibration=calibration)  # type: ignore[arg-type]
    return [(r.round_id, r.race.state["plan"], r.latency_s) for r in results]


@pytest.mark.slow
def test_decisions_for_past_rounds_do_not_change_when_the_future_is_shuffled() -> None:
    rounds = load_rounds(MOSS)
    base = _decisions(rounds, 18)
    for cut in (25, 40):
        later = [r.arms for r in rounds if r.round_id > cut]
        random.Random(cut).shuffle(later)
        shuffled = [r for r in rounds if r.round_id <= cut] + [
            Round(r.round_id, arms)
            for r, arms in zip([r for r in rounds if r.round_id > cut], later, strict=True)
        ]
        assert _decisions(shuffled, 18)[:cut] == base[:cut]


@pytest.mark.slow
def test_a_provider_a_race_did_not_launch_is_not_observed() -> None:
    rounds = load_rounds(MOSS)
    results = replay_adaptive(parse_policy(NAME), rounds, calibration=18)  # type: ignore[arg-type]
    changed = []
    for rnd, res in zip(rounds, results, strict=True):
        launched = {a.provider for a in res.race.attempts}
        arms = dict(rnd.arms)
        if rnd.round_id > 18:
            for p in set(arms) - launched:  # what it never asked for may be anything at all
                arms[p] = dataclasses.replace(arms[p], wall_s=0.5, valid=False)
        changed.append(Round(rnd.round_id, arms))
    again = replay_adaptive(parse_policy(NAME), changed, calibration=18)  # type: ignore[arg-type]
    assert [(r.race.state["plan"], r.latency_s) for r in again] == [
        (r.race.state["plan"], r.latency_s) for r in results
    ]


def test_a_cut_over_primary_is_known_only_to_have_queued_past_the_poll() -> None:
    own, learner = _own("adaptive:p->h")
    learner.plan, learner.fitted_at = Plan("h", None, 2.0, None, None), 0
    arms = {"p": Arm("p", 100.0, queue_delay_s=10.0), "h": Arm("h", 19.0)}
    race = run_race(own, arms)
    seen = observe(1, race.attempts, race.clock.now())
    primary = next(j for j in seen["jobs"] if j["provider"] == "p")
    assert primary["outcome"] == "censored"
    assert primary["at"] == pytest.approx(2.0)
    assert primary["queue_lo"] == pytest.approx(2.0)
    assert primary["queue_hi"] is None
    hedge = next(j for j in seen["jobs"] if j["provider"] == "h")
    assert (hedge["outcome"], hedge["at"]) == ("valid", pytest.approx(19.0))


def test_the_learned_state_survives_a_round_trip_through_json() -> None:
    import json

    own, learner = _own()
    for rnd in load_rounds(MOSS)[:30]:
        _feed(learner, rnd, run_race(own, rnd.arms), 18)
    again = Learner.from_dict(json.loads(json.dumps(learner.to_dict())), PUBLISHED_RATES)
    assert again.to_dict() == learner.to_dict()
    assert again.next_request() == learner.next_request()


def test_on_the_recorded_rounds_it_beats_the_static_policy_chosen_on_calibration() -> None:
    from gpuhedge_celery.core.replay import replay_policy, summarise_results

    rounds = load_rounds(MOSS)
    adaptive = summarise_results(
        [r for r in replay_adaptive(parse_policy(NAME), rounds, calibration=18) if r.round_id > 18]
    )  # type: ignore[arg-type]
    # the static a search on rounds 1-18 picks hedges on Modal (docs/policies.md)
    static = parse_policy("cutover:runpod->modal@q2.5s+s8.5s")
    chosen = summarise_results([r for r in replay_policy(static, rounds) if r.round_id > 18])
    assert adaptive.misses[60.0] == 0
    assert adaptive.p95_s + 1000 * adaptive.active_usd < chosen.p95_s + 1000 * chosen.active_usd
    # racing both hedges at the cutover matches the p95 of the cutover to Cerebrium alone
    # that hindsight picks (not its cost: Modal runs beside Cerebrium on every cold round)
    best = parse_policy("cutover:runpod->cerebrium@q1.5s+s8.5s")
    hindsight = summarise_results([r for r in replay_policy(best, rounds) if r.round_id > 18])
    assert adaptive.p95_s <= 1.05 * hindsight.p95_s


def test_on_a_budget_the_recorded_rounds_spend_their_tokens_on_the_cold_primaries() -> None:
    rounds = load_rounds(MOSS)
    policy = parse_policy(f"{NAME}@b0.2")
    results = replay_adaptive(policy, rounds, calibration=18)  # type: ignore[arg-type]
    cold = {r.round_id for r in rounds if r.round_id > 18 and r.arms["runpod"].wall_s > 60}
    hedged = {r.round_id for r in results if r.round_id > 18 and r.hedged}
    assert hedged == cold  # the budget covers them all, and nothing else


def test_a_slow_cancel_route_makes_a_cutover_cost_what_the_primary_runs_meanwhile() -> None:
    rates = {"p": PUBLISHED_RATES["runpod"], "h": PUBLISHED_RATES["cerebrium"]}
    cold = Point(100.0, True, 0.3, 3.0, 3.0)  # queued 3 s, then 97 s of work
    warm = Point(6.0, True, 0.7, 1.0, 1.0)
    plan = Plan("h", None, 2.0, None, None)

    def cost(cancel_s: float) -> float:
        scene = Scene("p", [cold, warm], [1.0, 3.0], {"h": [Point(19.0, True, 1.0)]}, rates, 60.0)
        scene = dataclasses.replace(scene, cancel_s=cancel_s)
        return estimate(scene, plan).active_usd

    # the cancel lands at 2 + 5 s: the cold primary ran from its start at 3 s until then
    assert cost(5.0) - cost(0.0) == pytest.approx(0.3 * 4.0 * rates["p"].rate_per_s)


def test_the_learner_reads_cancel_latency_and_raises_an_alarm_on_failures() -> None:
    learner = Learner("p", ("h", "b"), 60.0, rates=PUBLISHED_RATES)
    for seq, at in enumerate((0.5, 4.0, 4.0), 1):
        learner.seq = seq
        job = {"provider": "p", "role": "primary", "outcome": "censored", "at": 2.0, "cancel_s": at}
        learner.feed({"seq": seq, "jobs": [job]})
    assert learner.cancel_latency("p") == 4.0  # the weighted median
    assert not learner.in_alarm("h")
    for seq, outcome in ((4, "invalid"), (5, "valid"), (6, "invalid")):
        learner.seq = seq
        learner.feed({"seq": seq, "jobs": [{"provider": "h", "outcome": outcome, "at": 19.0}]})
    assert learner.in_alarm("h")  # two of its last three failed
    learner.seq += 30
    assert not learner.in_alarm("h")  # a cool-down, not a ban


def test_a_backup_cannot_join_beside_a_live_primary_in_the_estimate_either() -> None:
    rates = {p: PUBLISHED_RATES["runpod"] for p in "phb"}
    plan = Plan("h", "b", None, 2.0, 1.0)  # the backup would join 1 s after the hedge
    arms = {"p": Arm("p", 100.0), "h": Arm("h", 50.0), "b": Arm("b", 1.0)}
    learner = Learner("p", ("h", "b"), 120.0, rates=rates, plan=plan, fitted_at=0)
    race = run_race(AdaptivePolicy("p", ("h", "b"), 120.0).use(learner), arms)
    scene = Scene(
        "p",
        [Point(100.0, True, 1.0)],
        [],
        {"h": [Point(50.0, True, 1.0)], "b": [Point(1.0, True, 1.0)]},
        rates,
        120.0,
    )
    assert race.latency() == pytest.approx(52.0)
    assert estimate(scene, plan).p95_s == pytest.approx(52.0)


def test_a_failed_submit_is_a_failure_its_learner_sees() -> None:
    own, learner = _own("adaptive:p->h,b", {p: PUBLISHED_RATES["modal"] for p in "phb"})
    arms = {
        "p": Arm("p", 30.0),
        "h": Arm("h", 0.0, valid=False, submitted=False),
        "b": Arm("b", 5.0),
    }
    for _ in range(12):
        race = run_race(own, arms)
        learner.feed(observe(race.state["seq"], race.attempts, race.clock.now()))
    hedge = [j for j in observe(0, race.attempts, 0.0)["jobs"] if j["provider"] == "h"]
    assert all(j["outcome"] == "invalid" for j in hedge)
    assert learner.plan.hedge == "b"  # h failed every submit: the plan left it


def test_a_hedge_that_never_answers_stops_looking_fast() -> None:
    from gpuhedge_celery.core.adaptive_fit import Sample, points

    few = points([Sample(i, 10.0, "censored") for i in range(3)], 20.0)
    assert [(p.at, p.ok) for p in few] == [(20.0, True)]  # three unknowns: worth a try
    many = points([Sample(i, 10.0, "censored") for i in range(8)], 20.0)
    assert [(pytest.approx(p.at), p.ok) for p in many] == [
        (10.0, False)
    ]  # never seen to end: never answers


@pytest.mark.parametrize("watched_s", [0.02, 0.6])
def test_a_hedge_only_cut_short_by_a_fast_primary_is_still_tried_when_it_slows(
    watched_s: float,
) -> None:
    # explored beside a 25 ms primary, the hedge was cancelled each time before it could end;
    # the primary then takes 605 ms (a 3 s deadline, as a sim fleet on compressed time has)
    learner = Learner("p", ("h",), 3.0, rates={p: PUBLISHED_RATES["modal"] for p in "ph"})

    def race(seq: int, primary_s: float, hedged: bool) -> dict[str, object]:
        p = {"provider": "p", "outcome": "valid", "at": primary_s, "queue_hi": 0.005}
        h = {"provider": "h", "outcome": "censored", "at": watched_s}
        return {"seq": seq, "jobs": [p, h] if hedged else [p]}

    for seq in range(1, 25):
        learner.feed(race(seq, 0.025, hedged=seq <= 12))
    for seq in range(25, 65):
        learner.feed(race(seq, 0.605, hedged=False))
    learner.seq = 64
    learner.fit()
    est = learner.estimate
    assert est is not None
    if watched_s < 0.15:  # stopped long before anything could tell a hang: worth a try
        assert learner.plan.hedge == "h" and learner.plan.safety_s is not None
        assert learner.plan.safety_s < 0.3 and est.hedge_share > 0.6, (learner.plan, est)
    else:  # watched a fifth of the deadline a dozen times without an end: it hangs
        assert learner.plan.safety_s is None and est.hedge_share < 0.1, (learner.plan, est)


def test_a_hedge_refused_a_token_is_tried_again_when_the_primary_fails() -> None:
    learner = Learner("p", ("h",), 60.0, budget=0.0, rates=PUBLISHED_RATES, tokens=0.0)
    learner.plan, learner.fitted_at = Plan("h", None, None, 2.0, None), 0
    arms = {"p": Arm("p", 20.0, valid=False), "h": Arm("h", 5.0)}

    def refill(race: Race) -> None:
        if BUDGET_EMPTY in race.flags:
            learner.tokens = 1.0

    race = run_race(AdaptivePolicy("p", ("h",), budget=0.0).use(learner), arms, after_event=refill)
    assert race.winner is not None and race.latency() == pytest.approx(25.0)


def test_a_result_after_our_cancel_is_the_cancels_not_a_failure() -> None:
    from gpuhedge_celery.core.attempts import Attempt, Phase

    a = Attempt("a2", "h", "hedge", 2.0, Phase.ENDED, submitted_at=2.0, valid=False)
    a.result_state, a.result_at, a.cancel_sent_at = "FAILED", 5.2, 5.0
    b = Attempt("a3", "h", "hedge", 2.0, Phase.ENDED, submitted_at=2.0, valid=False)
    b.result_state, b.result_at = "CANCELLED", 4.0  # stopped by the provider, not by us
    jobs = observe(1, [a, b], 6.0)["jobs"]
    assert (jobs[0]["outcome"], jobs[0]["at"]) == ("censored", pytest.approx(3.0))
    assert (jobs[1]["outcome"], jobs[1]["at"]) == ("invalid", pytest.approx(2.0))


def test_a_token_is_spent_once_per_race_and_role() -> None:
    learner = Learner("p", ("h",), 60.0, budget=0.5, rates=PUBLISHED_RATES, tokens=1.0)
    assert learner.take_token("r1:hedge") and learner.take_token("r1:hedge")
    assert learner.tokens == 0.0
    assert not learner.take_token("r2:hedge")


def test_a_live_primarys_distinct_poll_bounds_leave_the_estimate_a_bounded_size() -> None:
    import random as rnd

    from gpuhedge_celery.core.adaptive_fit import MAX_POINTS, Sample

    r = rnd.Random(5)
    learner = Learner("p", ("h",), 60.0, rates={p: PUBLISHED_RATES["modal"] for p in "ph"})
    # a live fleet's watch polls see each job start at its own moment: every sample differs
    learner.samples["p"] = [
        Sample(i, r.uniform(5, 120), "valid", 0.0, r.uniform(0.5, 4.5)) for i in range(256)
    ]
    learner.samples["h"] = [Sample(i, r.uniform(18, 25), "valid") for i in range(256)]
    learner.seq = 256
    assert len(learner._points("p")) <= MAX_POINTS
    learner.fit()
    assert learner.plan.hedge == "h"


def test_the_kind_is_known_wherever_a_policy_name_is_parsed(tmp_path: Path) -> None:
    import subprocess
    import sys

    config = tmp_path / "c.yaml"
    config.write_text(
        "providers:\n"
        "  p: {role: primary, adapter: sim, billed_rate_per_s: 0.0003}\n"
        "  h: {role: hedge, adapter: sim, billed_rate_per_s: 0.0007}\n"
        "policy: {name: adaptive, params: {hedges: [h], budget: 0.2}}\n"
    )
    code = (
        "import sys; from gpuhedge_celery.core.policies import parse_policy;"
        "from gpuhedge_celery.config import load_config;"
        "print(parse_policy('adaptive:a->b').name, load_config(sys.argv[1]).make_policy().name)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(config)], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["adaptive:a->b@d60s", "adaptive:p->h@d60s+b0.2"]


# ------------------------------------------------------------- tails, tokens and probes


def test_a_backup_is_a_second_token_in_the_estimate() -> None:
    rates = {p: PUBLISHED_RATES["modal"] for p in "phb"}
    scene = Scene(
        "p",
        [Point(100.0, True, 0.5, 10.0, 10.0), Point(6.0, True, 0.5, 1.0, 1.0)],
        [1.0, 10.0],
        {"h": [Point(19.0, True, 1.0)], "b": [Point(30.0, True, 1.0)]},
        rates,
        60.0,
    )
    alone = estimate(scene, Plan("h", None, 2.0, None, None))
    both = estimate(scene, Plan("h", "b", 2.0, None, 0.0))  # both hedges at the cutover
    assert alone.hedge_share == pytest.approx(0.5) and alone.token_share == pytest.approx(0.5)
    assert both.hedge_share == pytest.approx(0.5) and both.token_share == pytest.approx(1.0)
    # on a budget of half a token a request, racing both leaves half the cold requests alone
    assert estimate(scene, Plan("h", None, 2.0, None, None), 0.5).miss_share == 0.0
    assert estimate(scene, Plan("h", "b", 2.0, None, 0.0), 0.5).miss_share == pytest.approx(0.25)


def test_a_backup_due_beside_a_live_primary_spends_no_token_until_a_slot_frees() -> None:
    plan = Plan("h", "b", None, 2.0, 1.0)  # the backup is due 1 s after the safety hedge

    def race(primary: Arm, tokens: float) -> tuple[Race, Learner]:
        learner = Learner("p", ("h", "b"), 120.0, budget=0.0, rates=PUBLISHED_RATES)
        learner.plan, learner.fitted_at, learner.tokens = plan, 0, tokens
        policy = AdaptivePolicy("p", ("h", "b"), 120.0, budget=0.0).use(learner)
        arms = {"p": primary, "h": Arm("h", 50.0), "b": Arm("b", 1.0)}
        return run_race(policy, arms, race_id="r"), learner

    done, learner = race(Arm("p", 100.0), 1.0)
    assert [a.provider for a in done.attempts] == ["p", "h"]
    assert BUDGET_EMPTY not in done.flags and learner.tokens == 0.0  # no token asked for
    assert done.latency() == pytest.approx(52.0)
    failed, learner = race(Arm("p", 10.0, valid=False), 2.0)  # the primary fails at 10 s
    assert [a.provider for a in failed.attempts] == ["p", "h", "b"]
    assert failed.latency() == pytest.approx(11.0) and learner.tokens == 0.0


def _tail_scene(n_eff: dict[str, float]) -> Scene:
    # 4 % of requests take 100 s, the rest 20 s: just under the 5 % a p95 ignores
    return Scene(
        "p",
        [Point(20.0, True, 0.96), Point(100.0, True, 0.04)],
        [],
        {},
        {"p": PUBLISHED_RATES["runpod"]},
        60.0,
        n_eff=n_eff,
    )


def test_a_tail_seen_in_few_jobs_counts_for_part_of_the_p95() -> None:
    exact = estimate(_tail_scene({}), Plan()).p95_s
    many = estimate(_tail_scene({"p": 10_000.0}), Plan()).p95_s
    few = estimate(_tail_scene({"p": 40.0}), Plan()).p95_s
    assert exact == pytest.approx(20.0) and many == pytest.approx(20.0)
    assert 20.0 < few < 100.0  # one standard error of a 5 % share in 40 jobs reaches the tail


def test_censored_weight_piled_on_a_few_jobs_leaves_fewer_effective_jobs() -> None:
    from gpuhedge_celery.core.adaptive_fit import Sample, effective_size

    seen = [Sample(i, 10.0, "valid") for i in range(40)]
    cut = [Sample(i, 10.0, "valid") for i in range(20)] + [
        Sample(20 + i, 15.0 if i else 30.0, "censored" if i else "valid") for i in range(20)
    ]  # nineteen stopped at 15 s; one job alone was seen to run past that
    assert effective_size(cut, 20.0) < 0.6 * effective_size(seen, 20.0)


def test_a_stale_hedge_races_beside_the_plans_hedge() -> None:
    learner = Learner("p", ("h", "b"), 60.0, rates=PUBLISHED_RATES)
    learner.plan, learner.seq = Plan("h", None, 2.0, None, None), 100
    learner.fitted_at = 100  # b was never watched
    arms = {"p": Arm("p", 100.0, queue_delay_s=10.0), "h": Arm("h", 19.0), "b": Arm("b", 30.0)}
    race = run_race(AdaptivePolicy("p", ("h", "b")).use(learner), arms)
    plan = Plan.from_dict(race.state["plan"])
    assert (plan.hedge, plan.backup, plan.backup_s) == ("h", "b", 0.0)
    assert race.latency() == pytest.approx(21.0)  # the plan's own latency
    learner.feed(observe(int(race.state["seq"]), race.attempts, race.clock.now()))
    assert learner.last_seen("b") == race.state["seq"]  # watched 19 s: seen, not probed again


def test_on_a_budget_an_unknown_hedge_is_tried_only_beside_a_stuck_primary() -> None:
    free = Learner("p", ("h",), 60.0, rates=PUBLISHED_RATES)
    budgeted = Learner("p", ("h",), 60.0, budget=0.2, rates=PUBLISHED_RATES)
    free.fit()
    budgeted.fit()
    assert free.plan.safety_s == 0.0  # beside every primary, to learn it
    assert budgeted.plan.hedge == "h" and budgeted.plan.safety_s and budgeted.plan.cutover_s


def _learned_with_a_near_plan() -> tuple[Learner, Plan]:
    """A learner fitted on 30 of GPUHedge's rounds, its plan swapped for one a hair off the best."""
    own, learner = _own()
    for rnd in load_rounds(MOSS)[:30]:
        _feed(learner, rnd, run_race(own, rnd.arms), 18)
    learner.fit()
    best = learner.plan
    near = dataclasses.replace(best, cutover_s=(best.cutover_s or 2.0) + 0.1, poll_s=None)
    learner.plan = near
    return learner, near


def test_a_plan_close_to_the_best_is_kept_rather_than_flapped() -> None:
    learner, near = _learned_with_a_near_plan()
    learner.fit()
    assert learner.plan in (near, learner.keep_plan)  # within the margin: no switch
    learner.plan = Plan("modal", None, 10.0, None, None)  # far worse on these rounds
    learner.fit()
    assert learner.plan != Plan("modal", None, 10.0, None, None)


def test_a_stale_hedge_takes_the_hedges_place_where_the_hedge_joins_a_live_primary() -> None:
    learner = Learner("p", ("h", "b"), 60.0, rates=PUBLISHED_RATES)
    learner.plan, learner.seq, learner.fitted_at = Plan("h", None, None, 8.5, None), 100, 100
    arms = {"p": Arm("p", 20.0), "h": Arm("h", 19.0), "b": Arm("b", 3.0)}
    race = run_race(AdaptivePolicy("p", ("h", "b")).use(learner), arms)
    assert [a.provider for a in race.attempts] == ["p", "b"]  # b was never watched
    assert race.latency() == pytest.approx(11.5)
    learner.feed(observe(int(race.state["seq"]), race.attempts, race.clock.now()))
    assert learner.last_seen("b") == race.state["seq"]


def test_a_probe_that_launched_nothing_is_tried_again_on_the_next_request() -> None:
    learner = Learner("p", ("h", "b"), 60.0, rates=PUBLISHED_RATES)
    learner.plan, learner.seq, learner.fitted_at = Plan("h", None, 2.0, None, None), 100, 100
    policy = AdaptivePolicy("p", ("h", "b")).use(learner)
    warm = {"p": Arm("p", 5.0, queue_delay_s=0.5), "h": Arm("h", 19.0), "b": Arm("b", 3.0)}
    race = run_race(policy, warm)  # the primary ran at the cutover: no hedge, so no probe
    assert [a.provider for a in race.attempts] == ["p"]
    assert Plan.from_dict(race.state["plan"]).backup == "b"
    learner.feed(observe(int(race.state["seq"]), race.attempts, race.clock.now()))
    cold = {"p": Arm("p", 100.0, queue_delay_s=10.0), "h": Arm("h", 19.0), "b": Arm("b", 3.0)}
    race = run_race(policy, cold)
    assert [a.provider for a in race.attempts] == ["p", "h", "b"]


@pytest.mark.parametrize(
    ("unknown", "latency"),
    [
        (Arm("u", 1000.0), 45.0),  # never answers: the kept primary does
        (Arm("u", 1.0, valid=False), 6.5),  # fails at once: the known hedge joins beside
    ],
)
def test_on_a_budget_an_unknown_hedge_never_stakes_a_stuck_request_alone(
    unknown: Arm, latency: float
) -> None:
    learner = Learner("p", ("h", "u"), 60.0, budget=0.2, rates=PUBLISHED_RATES)
    for i in range(20):
        learner.feed_paired(i, {"p": (2.0, True, 0.5), "h": (3.0, True, None)})
    policy = AdaptivePolicy("p", ("h", "u"), 60.0, budget=0.2).use(learner)
    arms = {"p": Arm("p", 45.0, queue_delay_s=40.0), "h": Arm("h", 3.0), "u": unknown}
    race = run_race(policy, arms, cap_s=120)
    assert Plan.from_dict(race.state["plan"]).hedge == "u"
    assert race.latency() == pytest.approx(latency, abs=0.5)


def test_the_primary_probe_never_hedges_with_a_provider_in_alarm() -> None:
    from gpuhedge_celery.core.adaptive_fit import Sample

    rates = {p: PUBLISHED_RATES["modal"] for p in ("p", "h", "c")}
    learner = Learner("p", ("h", "c"), 60.0, rates=rates)
    for i in range(40):
        queue = 20.0 if i % 4 == 0 else 0.5  # a quarter of the primaries queue 20 s
        learner._add("p", Sample(i, queue + 10.0, "valid", queue, queue))
        learner._add("h", Sample(i, 25.0, "valid"))
        learner._add("c", Sample(i, 4.0, "valid" if i < 38 else "invalid"))
    learner.seq = 40
    assert learner._check_alarm("c") and learner.in_alarm("c")
    learner.fit()
    assert learner.plan.backup == "c"  # a provider in alarm may still back a hedge up
    assert learner.keep_plan.hedge == "h"
    hedges = {learner.next_request()[1].hedge for _ in range(PRIMARY_PROBE * 2)}
    assert "c" not in hedges


def test_a_copy_through_json_keeps_the_switch_margin() -> None:
    learner, near = _learned_with_a_near_plan()
    copy = Learner.from_dict(json.loads(json.dumps(learner.to_dict())), PUBLISHED_RATES)
    assert copy.estimate == learner.estimate
    copy.fit()  # as a fleet refits its copy
    assert copy.plan in (near, copy.keep_plan)
    older = {k: v for k, v in learner.to_dict().items() if k != "estimate"}
    assert Learner.from_dict(older, PUBLISHED_RATES).estimate is None


def test_naming_a_provider_that_never_launches_leaves_the_p95_as_it_was() -> None:
    rates = {p: PUBLISHED_RATES["modal"] for p in ("p", "h", "b")}
    scene = Scene(
        "p",
        [Point(20.0, True, 0.96), Point(50.0, True, 0.04)],
        [],
        {"h": [Point(5.0, True, 1.0)], "b": [Point(5.0, True, 1.0)]},
        rates,
        60.0,
        n_eff={"p": 40.0, "h": 40.0, "b": 40.0},
    )
    # every primary ends before 59 s: neither hedge ever launches
    plans = (Plan(), Plan("h", None, None, 59.0), Plan("h", "b", None, 59.0, 50.0))
    found = [estimate(scene, plan) for plan in plans]
    assert all(e.hedge_share == 0.0 for e in found)
    assert found[1].p95_s == pytest.approx(found[0].p95_s)
    assert found[2].p95_s == pytest.approx(found[0].p95_s)
