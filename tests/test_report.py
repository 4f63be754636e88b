"""``gpuhedge-celery report``: percentiles, Wilson intervals, rates and costs, checked by hand.

Two small files, one per format, whose every expected figure is worked out below from the
definitions (nearest-rank: sorted[round(q*(n-1))], Python's round sending halves to even;
linear: interpolate between the two ranks around q*(n-1); a failed request is +inf, sorted
last, a miss at any deadline; Wilson 95 %: centre (p + z²/2n)/(1 + z²/n) ± z·sqrt(p(1-p)/n +
z²/4n²)/(1 + z²/n), z = 1.959964).
"""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from gpuhedge_celery.cli import cli

INF = math.inf
Z = 1.959963984540054


def wilson_by_hand(k: int, n: int) -> tuple[float, float]:
    """The Wilson 95 % interval written out term by term (not the package's function)."""
    p = k / n
    z2 = Z * Z
    denominator = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denominator
    half = Z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denominator
    return centre - half, centre + half


def race(race_id, policy, e2e_ms, *, winner="p", hedged=False, usd=0.001, billed=0.002,
         wasted=0.0, leaked=False, budget_key=None, arm=None):  # fmt: skip
    return {
        "v": 1, "kind": "race", "race_id": race_id, "ts": 1783857600.0, "policy": policy,
        "providers": ["p", "h"], "winner": winner, "e2e_ms": e2e_ms, "winner_ms": e2e_ms,
        "hedged": hedged, "cut_over": False, "escalated": False, "attempts": [], "cancels": [],
        "leaked": leaked, "usd": usd, "billed_usd": billed, "wasted_usd": wasted,
        "budget_key": budget_key, "arm": arm, "time_scale": 1.0,
    }  # fmt: skip


# Policy A: 6 races, e2e 1, 2, 3, 4, 10 s and one failed.
# Policy B: 4 races, e2e 0.5, 70, 1.5, 2.5 s.
OURS = [
    race("a1", "A", 1000.0, usd=0.001, billed=0.003),
    race("a2", "A", 2000.0, usd=0.002, billed=0.004, hedged=True, wasted=0.0005),
    race("a3", "A", 3000.0, usd=0.003, billed=0.005),
    race("a4", "A", 4000.0, usd=0.004, billed=0.006, hedged=True, wasted=0.001, leaked=True),
    race("a5", "A", 10000.0, usd=0.005, billed=0.007),
    race("a6", "A", None, winner=None, usd=0.009, billed=0.011, hedged=True, wasted=0.009),
    race("b1", "B", 500.0, budget_key="team-x"),
    race("b2", "B", 70000.0, hedged=True, budget_key="team-x"),
    race("b3", "B", 1500.0, budget_key="team-x"),
    race("b4", "B", 2500.0),
]


def write_jsonl(path, objects):
    path.write_text("".join(json.dumps(o) + "\n" for o in objects))
    return str(path)


def report_json(*args):
    result = CliRunner().invoke(cli, ["report", *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_our_records_reproduce_hand_checked_percentiles_and_wilson_intervals(tmp_path):
    path = write_jsonl(tmp_path / "ours.jsonl", OURS)
    doc = report_json(path, "--deadline", "3.5")
    assert doc["requests"] == 10 and doc["sources"] == {"gpuhedge-celery": 10, "gpuhedge": 0}
    a, b = doc["groups"]
    assert (a["group"], a["n"], a["failed"]) == ("A", 6, 1)
    # A sorted: [1, 2, 3, 4, 10, inf]; n - 1 = 5
    # p50: 0.5*5 = 2.5 -> round(2.5) = 2 (half to even) -> 3.0; linear 3 + 0.5*(4 - 3) = 3.5
    assert a["p50_s"] == 3.0 and a["p50_linear_s"] == pytest.approx(3.5)
    # p90: 4.5 -> round = 4 -> 10.0; linear between 10 and inf -> inf (JSON null)
    assert a["p90_s"] == 10.0 and a["p90_linear_s"] is None
    # p95: 4.75 -> 5 -> inf; p99: 4.95 -> 5 -> inf
    assert a["p95_s"] is None and a["p99_s"] is None and a["p99_linear_s"] is None
    # misses over 3.5 s: 4, 10 and the failed one -> 3/6; Wilson(3, 6) = 0.1876..0.8124
    assert a["misses"] == {"3.5": 3} and a["miss_rate"]["3.5"] == 0.5
    lo, hi = wilson_by_hand(3, 6)
    assert a["miss_ci"]["3.5"] == pytest.approx([lo, hi])
    assert [round(x, 4) for x in a["miss_ci"]["3.5"]] == [0.1876, 0.8124]
    # hedged a2, a4, a6 -> 3/6; $ means over 6: (1+2+3+4+5+9)/6 = 4 m$, billed (3+..+7+11)/6
    assert a["hedged"] == 3 and a["hedge_rate"] == 0.5
    assert a["active_usd_per_request"] == pytest.approx(0.024 / 6)
    assert a["billed_usd_per_request"] == pytest.approx(0.036 / 6)
    assert a["wasted_usd"] == pytest.approx(0.0105) and a["leaks"] == 1

    assert (b["group"], b["n"], b["failed"]) == ("B", 4, 0)
    # B sorted: [0.5, 1.5, 2.5, 70]; n - 1 = 3
    # p50: 1.5 -> round = 2 -> 2.5; linear 1.5 + 0.5*(2.5 - 1.5) = 2.0
    assert b["p50_s"] == 2.5 and b["p50_linear_s"] == pytest.approx(2.0)
    # p90: 2.7 -> 3 -> 70; linear 2.5 + 0.7*(70 - 2.5) = 49.75
    assert b["p90_s"] == 70.0 and b["p90_linear_s"] == pytest.approx(49.75)
    # p95: 2.85 -> 3 -> 70; linear 2.5 + 0.85*67.5 = 59.875
    assert b["p95_s"] == 70.0 and b["p95_linear_s"] == pytest.approx(59.875)
    # p99: 2.97 -> 3 -> 70; linear 2.5 + 0.97*67.5 = 67.975
    assert b["p99_s"] == 70.0 and b["p99_linear_s"] == pytest.approx(67.975)
    # misses over 3.5 s: only 70 -> 1/4; Wilson(1, 4) = 0.0456..0.6994
    assert b["misses"] == {"3.5": 1}
    assert b["miss_ci"]["3.5"] == pytest.approx(list(wilson_by_hand(1, 4)))
    assert [round(x, 4) for x in b["miss_ci"]["3.5"]] == [0.0456, 0.6994]
    assert b["hedge_rate"] == 0.25 and b["leaks"] == 0


def test_grouping_by_budget_key_and_a_repeated_race_counts_once(tmp_path):
    again = race("b4", "B", 2500.0, budget_key="team-x")  # b4's corrected, later record
    path = write_jsonl(tmp_path / "ours.jsonl", [*OURS, again])
    doc = report_json(path, "--by", "budget-key")
    assert doc["duplicates"] == 1 and doc["requests"] == 10
    assert [(g["group"], g["n"]) for g in doc["groups"]] == [("team-x", 4), ("-", 6)]
    by_provider = report_json(path, "--by", "provider")["groups"]
    assert [(g["group"], g["n"]) for g in by_provider] == [("p", 9), ("-", 1)]


# GPUHedge's live records. Each validation request is written twice (the full request, then
# its validation_index): the pair is one request. Latency: winner_total_ms, else
# winner_valid_at_ms; no winner: failed.
GPUHEDGE = [
    {"kind": "validation_plan", "stage": "validation", "order": ["queue-cutover"]},
    {"kind": "state_aware_request", "stage": "validation", "request_id": 1,
     "policy": "cutover:runpod->cerebrium@q2.5s+s8.5s", "cutover_fired": True,
     "safety_hedge_fired": False, "winner": "cerebrium", "winner_valid_at_ms": 19085.0,
     "winner_total_ms": 24703.2, "cancellation": {"provider": "runpod", "leaked": False}},
    {"kind": "validation_index", "stage": "validation", "request_id": 1, "block": 1,
     "arm": "queue-cutover", "policy": "cutover:runpod->cerebrium@q2.5s+s8.5s",
     "winner": "cerebrium", "winner_valid_at_ms": 19085.0, "winner_total_ms": 24703.2,
     "cutover_fired": True, "safety_hedge_fired": False, "cancelled": True},
    {"kind": "state_aware_request", "stage": "validation", "request_id": 2,
     "policy": "cutover:runpod->cerebrium@q2.5s+s8.5s", "cutover_fired": False,
     "safety_hedge_fired": False, "winner": "runpod", "winner_valid_at_ms": 5000.0,
     "winner_total_ms": 5000.0, "cancellation": None},
    {"kind": "validation_index", "stage": "validation", "request_id": 2, "block": 1,
     "arm": "queue-cutover", "policy": "cutover:runpod->cerebrium@q2.5s+s8.5s",
     "winner": "runpod", "winner_valid_at_ms": 5000.0, "winner_total_ms": 5000.0,
     "cutover_fired": False, "safety_hedge_fired": False, "cancelled": False},
    {"kind": "state_aware_request", "stage": "validation", "request_id": 3,
     "policy": "cutover:runpod->cerebrium@q2.5s+s8.5s", "cutover_fired": False,
     "safety_hedge_fired": True, "winner": None, "winner_valid_at_ms": None,
     "winner_total_ms": None, "cancellation": {"provider": "runpod", "leaked": True}},
    {"kind": "validation_index", "stage": "validation", "request_id": 3, "block": 1,
     "arm": "queue-cutover", "policy": "cutover:runpod->cerebrium@q2.5s+s8.5s",
     "winner": None, "winner_valid_at_ms": None, "winner_total_ms": None,
     "cutover_fired": False, "safety_hedge_fired": True, "cancelled": True},
    {"kind": "single_request", "stage": "validation", "request_id": 4, "policy": "single:runpod",
     "winner": "runpod", "winner_valid_at_ms": 109588.5, "winner_total_ms": 109588.5,
     "state": "COMPLETED", "valid": True, "cancellation": None},
    {"kind": "validation_index", "stage": "validation", "request_id": 4, "block": 2,
     "arm": "single-runpod", "policy": "single:runpod", "winner": "runpod",
     "winner_valid_at_ms": 109588.5, "winner_total_ms": 109588.5, "cutover_fired": None,
     "safety_hedge_fired": None, "cancelled": False},
    {"kind": "round", "stage": "moss", "round_id": 1},
    {"kind": "single_request", "stage": "validation", "request_id": 5, "policy": "single:runpod",
     "winner": "runpod", "winner_valid_at_ms": 6032.1, "winner_total_ms": 6032.1,
     "cancellation": None},
    {"kind": "validation_index", "stage": "validation", "request_id": 5, "block": 2,
     "arm": "single-runpod", "policy": "single:runpod", "winner": "runpod",
     "winner_valid_at_ms": 6032.1, "winner_total_ms": 6032.1, "cancelled": False},
    {"kind": "state_aware_request", "stage": "validation", "request_id": 6,
     "policy": "cutover:runpod->cerebrium@q2.5s+s8.5s", "winner": "runpod",
     "winner_total_ms": 30000.0, "cancellation": None},
    {"kind": "validation_index", "stage": "validation", "request_id": 6, "block": 3,
     "arm": "queue-cutover", "policy": "cutover:runpod->cerebrium@q2.5s+s8.5s",
     "winner": "runpod", "winner_total_ms": 30000.0, "cancelled": False},
    {"kind": "hedged_request", "stage": "live_hedge", "request_id": 1,
     "policy": "runpod->modal@10s", "hedge_launched": True, "winner": "modal",
     "winner_valid_at_ms": 56610.6, "cancellation": {"provider": "runpod", "leaked": False}},
    {"kind": "cost_snapshot", "label": "val-b01-queue-cutover-start"},
]  # fmt: skip


def test_gpuhedge_live_records_reproduce_hand_checked_figures_by_arm(tmp_path):
    path = write_jsonl(tmp_path / "gpuhedge.jsonl", GPUHEDGE)
    doc = report_json(path, "--by", "arm", "--deadline", "25")
    # 6 validation pairs count once each, plus the live_hedge request: 7 requests
    assert doc["requests"] == 7 and doc["sources"] == {"gpuhedge-celery": 0, "gpuhedge": 7}
    assert doc["skipped"] == {"validation_plan": 1, "round": 1, "cost_snapshot": 1}
    cut, single, none = doc["groups"]
    assert (cut["group"], cut["n"], cut["failed"]) == ("queue-cutover", 4, 1)
    # queue-cutover sorted: [5.0, 24.7032, 30.0, inf]; n - 1 = 3
    # p50: 1.5 -> round = 2 -> 30.0; linear 24.7032 + 0.5*(30 - 24.7032) = 27.3516
    assert cut["p50_s"] == 30.0 and cut["p50_linear_s"] == pytest.approx(27.3516)
    # p90: 2.7 -> 3 -> inf; linear between 30 and inf -> inf
    assert cut["p90_s"] is None and cut["p90_linear_s"] is None
    # misses over 25 s: 30 and the failed one -> 2/4; Wilson(2, 4) = 0.1500..0.8500
    assert cut["misses"] == {"25": 2}
    assert cut["miss_ci"]["25"] == pytest.approx(list(wilson_by_hand(2, 4)))
    assert [round(x, 4) for x in cut["miss_ci"]["25"]] == [0.1500, 0.8500]
    # hedged: request 1 (cutover) and 3 (safety hedge) -> 2/4; leaks: request 3's cancel
    assert cut["hedged"] == 2 and cut["hedge_rate"] == 0.5 and cut["leaks"] == 1
    # no costs in GPUHedge's records: n/a (null)
    assert cut["active_usd_per_request"] is None and cut["billed_usd_per_request"] is None
    assert cut["wasted_usd"] is None

    assert (single["group"], single["n"]) == ("single-runpod", 2)
    # single-runpod sorted: [6.0321, 109.5885]; n - 1 = 1
    # p50: 0.5 -> round(0.5) = 0 (half to even) -> 6.0321; linear midpoint 57.8103
    assert single["p50_s"] == pytest.approx(6.0321)
    assert single["p50_linear_s"] == pytest.approx(57.8103)
    # p90: 0.9 -> 1 -> 109.5885; linear 6.0321 + 0.9*103.5564 = 99.23286
    assert single["p90_s"] == pytest.approx(109.5885)
    assert single["p90_linear_s"] == pytest.approx(99.23286)
    # p95 linear 6.0321 + 0.95*103.5564 = 104.41068; p99 linear 6.0321 + 0.99*103.5564
    assert single["p95_linear_s"] == pytest.approx(104.41068)
    assert single["p99_s"] == pytest.approx(109.5885)
    assert single["p99_linear_s"] == pytest.approx(108.552936)
    # misses over 25 s: 109.6 -> 1/2; Wilson(1, 2) = 0.0945..0.9055
    assert single["misses"] == {"25": 1}
    assert [round(x, 4) for x in single["miss_ci"]["25"]] == [0.0945, 0.9055]
    assert single["hedged"] == 0 and single["leaks"] == 0

    # the live_hedge request has no arm; its latency is winner_valid_at_ms (no total)
    assert (none["group"], none["n"], none["hedged"]) == ("-", 1, 1)
    assert none["p50_s"] == pytest.approx(56.6106)


def test_both_formats_in_one_report_by_policy(tmp_path):
    ours = write_jsonl(tmp_path / "ours.jsonl", OURS)
    theirs = write_jsonl(tmp_path / "gpuhedge.jsonl", GPUHEDGE)
    doc = report_json(ours, theirs)
    assert doc["sources"] == {"gpuhedge-celery": 10, "gpuhedge": 7}
    names = [g["group"] for g in doc["groups"]]
    assert names == ["A", "B", "cutover:runpod->cerebrium@q2.5s+s8.5s", "runpod->modal@10s",
                     "single:runpod"]  # fmt: skip
    result = CliRunner().invoke(cli, ["report", ours, theirs], catch_exceptions=False)
    out = result.output
    assert "17 requests from 2 file(s): 10 gpuhedge-celery race records, 7 GPUHedge" in out
    skipped = "(cost_snapshot 1, round 1, validation_plan 1)"
    assert f"skipped 3 records that are not requests {skipped}" in out
    row_a = next(line for line in out.splitlines() if line.startswith("A "))
    # p50 3.00/3.50, p90 10.0/inf; 60 s deadline: only the failed one misses -> 1/6
    assert "3.00/3.50" in row_a and "10.0/inf" in row_a and "1/6 (" in row_a
    row_single = next(line for line in out.splitlines() if line.startswith("single:runpod"))
    assert "n/a" in row_single


def test_bad_input_is_one_line_naming_file_line_and_key(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(OURS[0]) + "\n{not json\n")
    result = CliRunner().invoke(cli, ["report", str(broken)])
    assert result.exit_code == 2 and f"{broken}:2: not JSON" in result.output
    no_policy = {k: v for k, v in OURS[0].items() if k != "policy"}
    path = write_jsonl(tmp_path / "nopolicy.jsonl", [no_policy])
    result = CliRunner().invoke(cli, ["report", path])
    assert result.exit_code == 2 and f"{path}:1: a 'race' record without 'policy'" in result.output
    no_id = {k: v for k, v in OURS[0].items() if k != "race_id"}
    path = write_jsonl(tmp_path / "noid.jsonl", [no_id])
    result = CliRunner().invoke(cli, ["report", path])
    assert result.exit_code == 2 and f"{path}:1: a 'race' record without 'race_id'" in result.output
    bad_ms = dict(OURS[0], e2e_ms="fast")
    path = write_jsonl(tmp_path / "badms.jsonl", [bad_ms])
    result = CliRunner().invoke(cli, ["report", path])
    assert result.exit_code == 2 and "'e2e_ms' must be a number, got 'fast'" in result.output
    only_rounds = write_jsonl(tmp_path / "rounds.jsonl", [{"kind": "round"}])
    result = CliRunner().invoke(cli, ["report", only_rounds])
    assert result.exit_code == 2 and "no requests in" in result.output
    result = CliRunner().invoke(cli, ["report", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 2 and "cannot read" in result.output


def validation_file(tmp_path):
    """A validation run in GPUHedge's shape: a plan, then per request the engine's record and,
    within a millisecond, its index row naming the arm. The fixed-hedge arm runs on the
    live-hedge engine, whose records say ``stage: live_hedge``; the index rows say
    ``validation``. 20 requests per arm, 15 of the cutover arm's cut over, every hedge arm's
    hedge launched."""
    arms = {
        "single-runpod": ("single_request", "validation", "single:runpod"),
        "queue-cutover": ("state_aware_request", "validation",
                          "cutover:runpod->cerebrium@q2.5s+s8.5s"),
        "fixed-hedge": ("hedged_request", "live_hedge", "runpod->modal@10s"),
    }  # fmt: skip
    lines = [{"kind": "validation_plan", "stage": "validation", "order": list(arms)}]
    t, request_id = 1_752_300_000.0, 0
    for block in range(1, 21):
        for arm, (kind, stage, policy) in arms.items():
            request_id += 1
            engine = {"kind": kind, "stage": stage, "request_id": request_id, "ts": t,
                      "policy": policy, "winner": "runpod", "winner_total_ms": 9000.0 + block,
                      "cancellation": None}  # fmt: skip
            if arm == "queue-cutover":
                engine["cutover_fired"] = block <= 15
                engine["safety_hedge_fired"] = False
            if arm == "fixed-hedge":
                engine["hedge_launched"] = True
            index = {"kind": "validation_index", "stage": "validation", "request_id": request_id,
                     "ts": t + 0.0004, "block": block, "arm": arm, "policy": policy,
                     "winner": "runpod", "winner_total_ms": engine["winner_total_ms"],
                     "cutover_fired": engine.get("cutover_fired"),
                     "safety_hedge_fired": engine.get("safety_hedge_fired")}  # fmt: skip
            lines += [engine, index]
            t += 30.0
    return write_jsonl(tmp_path / "validation.jsonl", lines)


def test_gpuhedge_validation_file_counts_each_request_once_in_its_arm(tmp_path):
    doc = report_json(validation_file(tmp_path), "--by", "arm")
    assert doc["requests"] == 60 and doc["sources"] == {"gpuhedge-celery": 0, "gpuhedge": 60}
    groups = {g["group"]: (g["n"], g["hedged"]) for g in doc["groups"]}
    assert groups == {"fixed-hedge": (20, 20), "queue-cutover": (20, 15), "single-runpod": (20, 0)}
