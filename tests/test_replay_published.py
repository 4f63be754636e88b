"""The replay reproduces GPUHedge's published evaluation table exactly (to printed precision).

Table and traces: GPUHedge's 2026-07 study (github.com/mireklzicar/gpuhedge, commit 669c8c9,
Apache-2.0), copied to tests/data with its attribution. Every row is produced by running the race
engine on a virtual clock, not by a closed-form formula.
"""

from __future__ import annotations

import pathlib

import pytest

from gpuhedge_celery.core.policies import parse_policy
from gpuhedge_celery.core.rates import PUBLISHED_RATES, ProviderRate
from gpuhedge_celery.core.replay import (
    default_policies,
    load_rounds,
    provider_table,
    replay_round,
    select,
    sweep,
)

TRACES = pathlib.Path(__file__).parent / "data" / "moss_rounds.jsonl"

# policy | p50 s | p95 s | miss>60 s | Wilson 95% | active $/req | billed $/req | hedge rate
PUBLISHED = [
    ("single:runpod", "6.0", "116.6", "11/36", "18–47%", "0.0114", "0.0298", "0"),
    ("single:modal", "37.8", "83.0", "5/36", "6–29%", "0.0295", "0.0295", "0"),
    ("single:cerebrium", "19.2", "20.2", "1/36", "0–14%", "0.0155", "0.0155", "0"),
    ("hedge:runpod->cerebrium@0s", "6.0", "19.4", "0/36", "0–10%", "0.0097", "0.0255", "36/36"),
    ("hedge:runpod->cerebrium@10s", "6.0", "29.4", "0/36", "0–10%", "0.0083", "0.0266", "11/36"),
    ("hedge:runpod->modal@10s", "6.0", "49.6", "1/36", "0–14%", "0.0133", "0.0317", "11/36"),
    (
        "cutover:runpod->cerebrium@q2.5s+s8.5s",
        "6.0",
        "21.9",
        "0/36",
        "0–10%",
        "0.0056",
        "0.0183",
        "11/36",
    ),
]


@pytest.fixture(scope="module")
def rounds():
    return load_rounds(TRACES)


@pytest.mark.parametrize("expected", PUBLISHED, ids=[row[0] for row in PUBLISHED])
def test_published_evaluation_row(rounds, expected):
    name = expected[0]
    [row] = sweep(rounds, [parse_policy(name)], ["evaluation"], [60.0], PUBLISHED_RATES)
    lo, hi = row["miss_ci"]["60"]
    hedges = f"{row['hedged']}/{row['n']}" if row["hedged"] else "0"
    got = (
        row["policy"],
        f"{row['p50_s']:.1f}",
        f"{row['p95_s']:.1f}",
        f"{row['misses']['60']}/{row['n']}",
        f"{lo * 100:.0f}–{hi * 100:.0f}%",
        f"{row['active_usd']:.4f}",
        f"{row['billed_usd']:.4f}",
        hedges,
    )
    assert got == expected
    assert row["n"] == 36


def test_published_per_provider_figures(rounds):
    table = {p["provider"]: p for p in provider_table(rounds)}
    got = {
        name: (p["valid"], f"{p['p50_s']:.1f}", f"{p['p95_s']:.1f}", f"{p['max_s']:.1f}")
        for name, p in table.items()
    }
    assert got == {
        "runpod": (54, "6.1", "120.1", "122.2"),
        "modal": (54, "38.4", "96.8", "111.6"),
        "cerebrium": (53, "19.3", "98.5", "104.3"),
    }
    low, high = table["runpod"]["queue_delay_s"]
    assert (round(low, 1), round(high, 1)) == (1.1, 27.6)


def test_subsets_split_at_round_18(rounds):
    assert len(rounds) == 54
    assert [len(select(rounds, s)) for s in ("all", "calibration", "evaluation")] == [54, 18, 36]


def test_default_sweep_covers_every_family(rounds):
    families = [family for family, _ in default_policies(rounds)]
    assert families.count("single") == 3
    assert families.count("race") == 6
    assert families.count("fixed") == 6 * 7  # grid 5..60 s for every ordered pair
    assert families.count("cutover") == 2  # only RunPod records a queue signal
    assert families.count("cascade") == 2
    rows = sweep(rounds, [p for _, p in default_policies(rounds)])
    assert len(rows) == 55 * 3


def test_invalid_arm_counts_as_never(rounds):
    [row] = sweep(rounds, [parse_policy("single:cerebrium")], ["all"])
    assert row["n"] == 54 and row["max_s"] is None and row["misses"]["60"] >= 1


def test_state_machine_hedges_at_once_after_a_failed_submit(rounds):
    """A documented difference from a closed-form replay: round 13's Cerebrium submit failed,
    so a fixed hedge launches its backup at 0 s instead of waiting for the 10 s timer."""
    round13 = next(r for r in rounds if r.round_id == 13)
    result = replay_round(parse_policy("hedge:cerebrium->modal@10s"), round13)
    hedge = result.race.attempt_for("hedge")
    assert hedge.launched_at == 0.0
    assert result.latency_s == pytest.approx(round13.arms["modal"].wall_s)


def test_rates_can_be_passed_in(rounds):
    free = {name: ProviderRate(0.0) for name in ("runpod", "modal", "cerebrium")}
    [row] = sweep(rounds, [parse_policy("hedge:runpod->modal@10s")], ["all"], rates=free)
    assert row["active_usd"] == 0.0 and row["billed_usd"] == 0.0
