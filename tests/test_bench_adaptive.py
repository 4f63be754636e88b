"""`bench adaptive`: its JSON rows, the J ratios, the static choices, and one-line errors."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from click.testing import CliRunner

from gpuhedge_celery.cli import cli
from gpuhedge_celery.core.policies import parse_policy
from gpuhedge_celery.core.replay import parse_rounds, replay_policy, summarise_results
from gpuhedge_celery.providers.sim_traces import synth_rounds

# A small paired-round trace whose primary slows down at round 31 (calibration <= 20).
SPEC = {
    "rounds": 60,
    "seed": 5,
    "providers": {
        "runpod": {
            "slow_probability": 0.3,
            "fast": {"queue_s": [1.1, 1.3], "run_s": [4.4, 5.4]},
            "slow": {"queue_s": [9, 27], "run_s": [80, 95]},
        },
        "modal": {"queue_signal": False, "fast": {"queue_s": [0.5, 2], "run_s": [26, 43]}},
        "cerebrium": {
            "queue_signal": False,
            "fail_probability": 0.02,
            "fast": {"queue_s": [0.3, 0.8], "run_s": [17.5, 19.7]},
        },
    },
    "shifts": [{"at_round": 31, "providers": {"runpod": {"fast": {"run_s": [11, 14]}}}}],
}
ROW_KEYS = {
    "trace",
    "calibration",
    "rounds",
    "policy",
    "adaptive",
    "calibration_static",
    "hindsight_static",
    "J_vs_hindsight",
    "J_vs_calibration_static",
    "replay_wall_s",
    "static_wall_s",
    "static_candidates",
}
FIGURE_KEYS = {
    "policy",
    "J",
    "p95_s",
    "p50_s",
    "active_usd",
    "billed_usd",
    "misses_60s",
    "hedged",
    "n",
}
POLICIES = ["adaptive:runpod->cerebrium,modal@d60s", "adaptive:runpod->cerebrium,modal@d60s+b0.2"]


def invoke(*args: str):
    return CliRunner().invoke(cli, ["bench", "adaptive", *args])


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_adaptive") / "small.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    return path


@pytest.fixture(scope="module")
def bench(spec_path):
    result = invoke("--spec", f"{spec_path}:20", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.fixture(scope="module")
def rounds():
    return parse_rounds(json.dumps(r) for r in synth_rounds(SPEC))


def _j(fig):
    return math.inf if fig["J"] is None else fig["J"]


def _summary(rounds, name, subset, calibration=20):
    """A policy's J and summary on one side of the split, computed here from the replay."""
    results = replay_policy(parse_policy(name), rounds, None, calibration)
    wanted = [r for r in results if (r.round_id > calibration) == (subset == "evaluation")]
    s = summarise_results(wanted)
    return round(s.p95_s + 1000 * s.active_usd, 4), s


def test_json_has_the_documented_keys(bench, spec_path):
    assert bench["bench"] == "adaptive" and set(bench) == {"bench", "results", "wall_s"}
    assert [r["policy"] for r in bench["results"]] == POLICIES
    for row in bench["results"]:
        assert set(row) == ROW_KEYS
        assert row["trace"] == str(spec_path) and row["calibration"] == 20 and row["rounds"] == 60
        assert set(row["adaptive"]) == FIGURE_KEYS == set(row["hindsight_static"])
        assert set(row["calibration_static"]) == FIGURE_KEYS | {"calibration_J"}
        for fig in (row["adaptive"], row["calibration_static"], row["hindsight_static"]):
            assert fig["n"] == 40 and 0 <= fig["misses_60s"] <= 40 and 0 <= fig["hedged"] <= 40
            assert fig["billed_usd"] >= fig["active_usd"] > 0
        # the 55-policy sweep and a grid of 46 cutovers, two of which (q2.5s+s8.5s) it holds
        assert row["static_candidates"] == 55 + 46 - 2
        assert row["replay_wall_s"] > 0 and row["static_wall_s"] > 0
        assert bench["wall_s"] >= row["replay_wall_s"] + row["static_wall_s"]


def test_ratios_are_computed_from_the_printed_js(bench):
    for row in bench["results"]:
        adaptive = row["adaptive"]["J"]
        pairs = [("J_vs_hindsight", "hindsight_static")]
        pairs.append(("J_vs_calibration_static", "calibration_static"))
        for key, other in pairs:
            if adaptive is None or row[other]["J"] is None:
                assert row[key] is None
            else:
                assert row[key] == round(adaptive / row[other]["J"], 4)


def test_hindsight_is_the_best_static_on_the_evaluation_rounds(bench, rounds):
    row = bench["results"][0]
    hindsight, deployed = row["hindsight_static"], row["calibration_static"]
    assert _j(hindsight) <= _j(deployed)
    for name in ("single:cerebrium", "hedge:runpod->cerebrium@10s", "cutover:runpod->modal"):
        assert _j(hindsight) <= _summary(rounds, name, "evaluation")[0]
    j, s = _summary(rounds, hindsight["policy"], "evaluation")
    assert (hindsight["J"], hindsight["hedged"]) == (j, s.hedged)
    j, s = _summary(rounds, deployed["policy"], "evaluation")
    assert (deployed["J"], deployed["misses_60s"]) == (j, s.misses[60.0])
    # every adaptive policy on a trace is compared with the same static choices
    assert all(r["hindsight_static"] == hindsight for r in bench["results"])
    assert all(r["calibration_static"] == deployed for r in bench["results"])


def test_calibration_choice_is_the_lowest_j_on_the_calibration_rounds(bench, rounds):
    deployed = bench["results"][0]["calibration_static"]
    assert deployed["calibration_J"] == _summary(rounds, deployed["policy"], "calibration")[0]
    for name in ("single:cerebrium", "hedge:runpod->cerebrium@0s", "cutover:runpod->modal"):
        assert deployed["calibration_J"] <= _summary(rounds, name, "calibration")[0]


@pytest.mark.slow
def test_adaptive_figures_are_its_own_replay_on_the_evaluation_rounds(bench, rounds):
    for row in bench["results"]:
        j, s = _summary(rounds, row["policy"], "evaluation")
        fig = row["adaptive"]
        assert _j(fig) == j
        assert (fig["misses_60s"], fig["hedged"], fig["n"]) == (s.misses[60.0], s.hedged, s.n)
        assert fig["billed_usd"] == round(s.billed_usd, 6)


@pytest.mark.slow
def test_text_table_names_every_policy(spec_path):
    result = invoke("--spec", f"{spec_path}:20", "--policy", "adaptive:runpod->cerebrium")
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"{spec_path}  calibration <= 20, evaluation n = 40" in out
    for label in ("adaptive", "calibration", "hindsight"):
        assert f"\n  {label} " in out
    assert "adaptive:runpod->cerebrium@d60s" in out and "J / hindsight" in out
    assert out.rstrip().splitlines()[-1].startswith("bench wall ")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--trace", "no/such/traces.jsonl"], "--trace no/such/traces.jsonl: no such file"),
        (["--spec", "no/such/spec.yaml:20"], "--spec no/such/spec.yaml: no such file"),
        (["--spec", "{spec}:twenty"], "CAL after ':' must be an integer"),
        (["--spec", "{spec}:60"], "calibration 60 leaves no calibration or evaluation rounds"),
        (["--spec", "{spec}:0"], "calibration 0 leaves no calibration or evaluation rounds"),
        (["--spec", "{spec}:20", "--policy", "single:runpod"], "expected adaptive:PRIMARY"),
        (["--spec", "{spec}:20", "--policy", "adaptive:runpod"], "bad --policy"),
        (["--spec", "{spec}:20", "--policy", "adaptive:runpod->lambda"], "no lambda for"),
        (["--trace", "{spec}:20"], "not JSON"),
    ],
)
def test_bad_arguments_give_a_one_line_error(spec_path, args, expected):
    result = invoke(*(a.replace("{spec}", str(spec_path)) for a in args))
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1
    assert expected in result.output


def test_a_bad_spec_names_its_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**SPEC, "rounds": "many"}))
    result = invoke("--spec", str(bad))
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert str(bad) in result.output and "rounds" in result.output


@pytest.mark.slow
def test_defaults_are_the_recorded_traces_and_the_specs_found(tmp_path, monkeypatch):
    (tmp_path / "config" / "traces").mkdir(parents=True)
    longer = {**SPEC, "rounds": 110}  # past the default calibration of 100 rounds
    (tmp_path / "config" / "traces" / "small.yaml").write_text(yaml.safe_dump(longer))
    monkeypatch.chdir(tmp_path)  # no tests/data here: the recorded traces come from the checkout
    result = invoke("--json", "--policy", "adaptive:runpod->cerebrium")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["results"]
    assert rows[0]["trace"].endswith("tests/data/moss_rounds.jsonl")
    assert rows[1]["trace"] == "config/traces/small.yaml" and len(rows) == 2
    assert [(r["calibration"], r["adaptive"]["n"]) for r in rows] == [(18, 36), (100, 10)]
