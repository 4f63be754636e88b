"""The pure parts of the measurement commands: the preregistration, its seeded block order, and
the cancel audit's matrix."""

from __future__ import annotations

import pathlib
from collections import Counter

import pytest
import yaml

from gpuhedge_celery.core.cancel_audit import format_matrix, tally
from gpuhedge_celery.core.experiment import block_order, parse_prereg, primary_value, schedule
from gpuhedge_celery.errors import ConfigError

EXAMPLE = pathlib.Path(__file__).parent.parent / "config" / "experiments" / "example.yaml"
PLAN = {
    "seed": 7,
    "arms": [{"name": "a", "policy": "single"}, {"name": "b", "policy": "fixed",
                                                  "providers": ["p", "h"]}],
    "blocks_per_arm": 3,
    "block_size": 2,
    "cadence_s": 1.5,
    "primary_metric": "p95",
}  # fmt: skip


def test_block_order_is_seeded_balanced_and_shuffled():
    order = block_order(["a", "b", "c"], 4, seed=11)
    assert order == block_order(["a", "b", "c"], 4, seed=11)  # same seed, same order
    assert Counter(order) == {"a": 4, "b": 4, "c": 4}
    orders = {tuple(block_order(["a", "b", "c"], 4, seed=s)) for s in range(20)}
    assert len(orders) > 10  # the seed matters


def test_schedule_runs_whole_blocks_on_the_cadence():
    plan = parse_prereg(PLAN, "p.yaml")
    slots = schedule(plan)
    assert plan.requests == len(slots) == 12
    assert [s.at_s for s in slots] == [i * 1.5 for i in range(12)]
    for block in range(1, 7):  # each block: block_size consecutive requests of one arm
        arms = {s.arm for s in slots if s.block == block}
        assert len(arms) == 1 and sum(s.block == block for s in slots) == 2
    assert [s.arm for s in slots[::2]] == block_order(["a", "b"], 3, 7)
    assert plan.arm("b").providers == ("p", "h")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bogus": 1}, "p.yaml: bogus: unknown key"),
        ({"arms": [{"name": "a", "policy": "single"}]},
         "p.yaml: arms: expected a list of at least two"),
        ({"arms": [{"name": "a", "policy": "single"}, {"name": "a", "policy": "fixed"}]},
         "p.yaml: arms: arm 'a' appears twice"),
        ({"arms": [{"name": "a", "policy": "single"}, {"name": "b", "polcy": "x"}]},
         "p.yaml: arms[1].polcy: unknown key"),
        ({"arms": [{"name": "a b", "policy": "single"}, {"name": "b", "policy": "x"}]},
         "p.yaml: arms[0].name: expected an arm name"),
        ({"primary_metric": "p42"}, "p.yaml: primary_metric: expected one of p50"),
        ({"blocks_per_arm": 0}, "p.yaml: blocks_per_arm: expected a whole number >= 1"),
        ({"block_size": 1.5}, "p.yaml: block_size: expected a whole number"),
        ({"seed": None}, "p.yaml: seed: required"),
        ({"cadence_s": -1}, "p.yaml: cadence_s: expected seconds >= 0"),
        ({"request": [1]}, "p.yaml: request: expected a mapping"),
        ({"blocks_per_arm": 60_000}, "p.yaml: blocks_per_arm: 240,000 requests"),
    ],
)  # fmt: skip
def test_a_bad_plan_is_a_one_line_error_naming_key_and_file(change, message):
    with pytest.raises(ConfigError) as e:
        parse_prereg({**PLAN, **change}, "p.yaml")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_example_preregistration_loads():
    plan = parse_prereg(yaml.safe_load(EXAMPLE.read_text()), str(EXAMPLE))
    assert [a.name for a in plan.arms] == ["single", "hedge10", "cutover"]
    assert plan.requests == 60 and plan.primary_metric == "p95" and plan.deadline_s == 30
    assert plan.request == {"text": "Hello from a preregistered experiment."}


def test_primary_value_reads_a_report_row():
    row = {"p95_s": 3.5, "miss_rate": {"30": 0.25}, "hedge_rate": 0.5}
    assert primary_value(row, "p95", 30.0) == 3.5
    assert primary_value(row, "miss_rate", 30.0) == 0.25
    assert primary_value(row, "hedge_rate", 30.0) == 0.5


def test_the_cancel_matrix_counts_attempts_terminal_leaks_and_running():
    def record(provider, phase, **receipt):
        return {"kind": "forced_cancel", "provider": provider, "phase": phase, "receipt": receipt}

    records = [
        record("rp", "early", evidence="confirmed_terminal", leaked=False, was_running=False),
        record("rp", "early", evidence="confirmed_terminal", leaked=False, was_running=True),
        record("rp", "late", evidence="confirmed_terminal", leaked=False, was_running=True),
        record("m", "late", evidence="provider_ack", leaked=True, was_running=None),
        {"kind": "cancel_audit_summary", "matrix": {}},  # not a cancel: ignored
    ]
    matrix = tally(records)
    assert matrix == {
        "rp": {"early": {"attempts": 2, "terminal": 2, "leaked": 0, "was_running": 1},
               "late": {"attempts": 1, "terminal": 1, "leaked": 0, "was_running": 1}},
        "m": {"late": {"attempts": 1, "terminal": 0, "leaked": 1, "was_running": 0}},
    }  # fmt: skip
    lines = format_matrix(matrix, ["rp", "m"])
    assert len(lines) == 4 and lines[3].split() == ["m", "late", "1", "0", "1", "0"]


def test_the_example_dry_runs_on_the_packaged_config(capsys, monkeypatch):
    from gpuhedge_celery.cli import EXIT_OK, main

    monkeypatch.delenv("GPUHEDGE_CONFIG", raising=False)
    default = EXAMPLE.parents[2] / "gpuhedge_celery" / "data" / "default.yaml"
    code = main(["--config", str(default), "experiment", str(EXAMPLE), "--dry-run"])
    out = capsys.readouterr().out
    assert code == EXIT_OK
    order = block_order(["single", "hedge10", "cutover"], 4, 20261201)
    assert f"block order (seed 20261201): {' '.join(order)}" in out
    assert "arm cutover: cutover:sim-cheap->sim-steady@q2.5s+s8.5s, worst case $" in out
    assert out.rstrip().splitlines()[-1].startswith("worst-case spend: $")
