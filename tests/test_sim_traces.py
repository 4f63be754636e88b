"""Synthetic paired-round traces: seeded sim fates, regime shifts, the `traces synth` command."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml
from click.testing import CliRunner

from gpuhedge_celery.cli import cli
from gpuhedge_celery.core.jobs import JobState
from gpuhedge_celery.core.replay import load_rounds, parse_rounds
from gpuhedge_celery.core.stats import nearest_rank
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.providers.sim import SimProvider
from gpuhedge_celery.providers.sim_traces import parse_spec, segments, summary, synth_rounds

EXAMPLES = pathlib.Path(__file__).parent.parent / "config" / "traces"
SPEC = {
    "rounds": 30,
    "seed": 11,
    "providers": {
        "runpod": {"slow_probability": 0.4, "invalid_probability": 0.1},
        "modal": {"slow_probability": 0.2, "queue_signal": False},
        "cerebrium": {"fail_probability": 0.1, "queue_signal": False},
    },
}
SHIFTED = SPEC | {
    "shifts": [
        {"at_round": 11, "providers": {"runpod": {"slow": {"run_s": [200, 210]}}}},
        {"at_round": 21, "providers": {"modal": {"fast": {"run_s": 50}}}},
    ]
}


def arms(records, provider):
    return [r["providers"][provider] for r in records]


def synth_cli(spec_path, out_path):
    return CliRunner().invoke(cli, ["traces", "synth", str(spec_path), "-o", str(out_path)])


def test_same_spec_same_output_and_another_seed_differs(tmp_path):
    assert synth_rounds(SHIFTED) == synth_rounds(json.loads(json.dumps(SHIFTED)))
    assert synth_rounds(SHIFTED | {"seed": 12}) != synth_rounds(SHIFTED)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SHIFTED, sort_keys=False))
    for out in ("a.jsonl", "b.jsonl"):
        assert synth_cli(spec, tmp_path / out).exit_code == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_arms_are_the_sim_adapters_own_draws():
    records = synth_rounds(SPEC)
    spec = parse_spec(SPEC)
    for provider in SPEC["providers"]:
        sim = SimProvider(provider, spec.regime(provider, 1).spec)
        for r, arm in zip(records, arms(records, provider), strict=True):
            fate = sim.draw(f"{provider}:{r['round_id']}")
            assert arm["wall_s"] == round(fate["queue_s"] + fate["run_s"], 6)
            assert arm["sim"]["outcome"] == fate["outcome"]
            assert arm["valid"] == (fate["outcome"] == "ok")
            assert arm["state"] == ("FAILED" if fate["outcome"] == "failed" else "COMPLETED")
    outcomes = {a["sim"]["outcome"] for p in SPEC["providers"] for a in arms(records, p)}
    assert outcomes == {"ok", "invalid", "failed"}


def test_a_providers_draws_ignore_the_other_providers():
    alone = SPEC | {"providers": {"modal": SPEC["providers"]["modal"]}}
    assert arms(synth_rounds(alone), "modal") == arms(synth_rounds(SPEC), "modal")


def test_shifts_apply_from_at_round_on_and_only_to_the_named_providers():
    base, shifted = synth_rounds(SPEC), synth_rounds(SHIFTED)
    for provider in ("runpod", "modal", "cerebrium"):
        start = {"runpod": 11, "modal": 21, "cerebrium": 31}[provider]
        before, after = arms(base, provider), arms(shifted, provider)
        assert after[: start - 1] == before[: start - 1]
        for old, new in zip(before[start - 1 :], after[start - 1 :], strict=True):
            assert new["sim"]["regime_from"] == start
            if provider == "cerebrium":
                assert new == old
            elif provider == "runpod" and old["sim"]["slow"]:
                assert 200 <= new["sim"]["run_s"] <= 210  # the shifted slow run
                assert new["sim"]["queue_s"] == old["sim"]["queue_s"]  # merged: base queue kept
            elif provider == "modal" and not old["sim"]["slow"]:
                assert new["sim"]["run_s"] == 50
            else:
                assert new["wall_s"] == old["wall_s"]  # the mode the shift did not touch
    assert sum(a["sim"]["slow"] for a in arms(shifted, "runpod")[10:]) > 0  # the shift shows


def test_a_later_shift_merges_over_the_base_block_not_the_earlier_shift():
    spec = SPEC | {
        "shifts": [
            {"at_round": 5, "providers": {"modal": {"fast": {"run_s": 50}}}},
            {"at_round": 9, "providers": {"modal": {"fast": {"queue_s": 3}}}},
        ]
    }
    modal = arms(synth_rounds(spec), "modal")
    fast = [(i + 1, a["sim"]) for i, a in enumerate(modal) if not a["sim"]["slow"]]
    assert any(5 <= r < 9 for r, _ in fast) and any(r >= 9 for r, _ in fast)
    for r, fate in fast:
        assert (fate["run_s"] == 50) == (5 <= r < 9)
        assert (fate["queue_s"] == 3) == (r >= 9)


def test_queue_signal_and_states_as_replay_reads_them():
    rounds = parse_rounds([json.dumps(r) for r in synth_rounds(SPEC)])
    assert [r.round_id for r in rounds] == list(range(1, 31))
    records = synth_rounds(SPEC)
    for rnd, record in zip(rounds, records, strict=True):
        runpod = rnd.arms["runpod"]
        queue_s = record["providers"]["runpod"]["sim"]["queue_s"]
        assert runpod.queue_delay_s == pytest.approx(queue_s)
        assert rnd.arms["modal"].queue_delay_s is None
        assert rnd.arms["cerebrium"].queue_delay_s is None
        for provider, arm in rnd.arms.items():
            outcome = record["providers"][provider]["sim"]["outcome"]
            assert arm.state is (JobState.FAILED if outcome == "failed" else JobState.COMPLETED)
            assert arm.valid == (outcome == "ok")


def test_replay_accepts_the_output_and_reads_the_same_walls(tmp_path):
    spec, out = tmp_path / "spec.yaml", tmp_path / "out.jsonl"
    spec.write_text(yaml.safe_dump(SHIFTED, sort_keys=False))
    made = synth_cli(spec, out)
    assert made.exit_code == 0, made.output
    line = made.stderr.strip()
    assert "\n" not in line and line.startswith(f"wrote {out}: 30 rounds; rounds 1-10: runpod ")
    assert "; rounds 11-20: " in line and "; rounds 21-30: " in line
    result = CliRunner().invoke(
        cli, ["replay", str(out), "--policy", "single:runpod", "--subset", "all", "--json"]
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)
    records = [json.loads(x) for x in out.read_text().splitlines()]
    runpod = arms(records, "runpod")
    walls = [a["wall_s"] if a["valid"] else float("inf") for a in runpod]
    assert row["policy"] == "single:runpod" and row["n"] == 30
    assert row["p50_s"] == pytest.approx(nearest_rank(walls, 0.5))


def test_summary_splits_at_every_shift():
    assert segments(30, (11, 21)) == [(1, 10), (11, 20), (21, 30)]
    assert segments(30, ()) == [(1, 30)]
    records = synth_rounds(SHIFTED)
    text = summary(records, parse_spec(SHIFTED).shift_rounds)
    valid = sum(a["valid"] for a in arms(records, "runpod")[:10])
    assert text.startswith(f"30 rounds; rounds 1-10: runpod {valid}/10 valid p50 ")


def bad(providers=None, shifts=None, **top):
    """A three-round spec over provider ``a`` with the given changes."""
    spec = {"rounds": 3, "providers": {"a": {}} if providers is None else providers} | top
    return spec if shifts is None else spec | {"shifts": shifts}


def at(round_id, providers=None, **item):
    return {"at_round": round_id, "providers": {"a": {}} if providers is None else providers} | item


@pytest.mark.parametrize(
    "spec,key,fragment",
    [
        ({"providers": {"a": {}}}, "rounds", "required key is missing"),
        (bad(rounds=0), "rounds", "expected an integer >= 1"),
        ({"rounds": 3}, "providers", "at least one provider"),
        (bad(shift=[]), "shift", "did you mean 'shifts'"),
        (bad({"a": {"sed": 1}}), "providers.a.sed", "did you mean 'seed'"),
        (bad({"a": {"queue_signal": "no"}}), "providers.a.queue_signal", "true or false"),
        (bad({"a": {"fast": {"run_s": [3, 1]}}}), "providers.a.fast.run_s", "low <= high"),
        (bad(shifts={"at_round": 2}), "shifts", "expected a list"),
        (bad(shifts=0), "shifts", "expected a list"),
        (bad(shifts=[at(4)]), "shifts[0].at_round", "<= 3"),
        (bad(shifts=[at(1)]), "shifts[0].at_round", ">= 2"),
        (bad(shifts=[at(3), at(2)]), "shifts[1].at_round", "expected >= 3"),
        (bad(shifts=[at(2), at(2)]), "shifts[1].providers.a", "shifted twice"),
        (bad({"ab": {}}, [at(2, {"abc": {}})]), "shifts[0].providers.abc", "did you mean 'ab'"),
        (bad(shifts=[at(2, {})]), "shifts[0].providers", "at least one provider"),
        (bad(shifts=[at(2, at=2)]), "shifts[0].at", "unknown key"),
        (bad(shifts=[{"providers": {"a": {}}}]), "shifts[0].at_round", "required key is missing"),
        (
            bad(shifts=[at(2, {"a": {"slow_probability": 2}})]),
            "shifts[0].providers.a.slow_probability",
            "<= 1",
        ),
        (bad(shifts=[at(2, {"a": {"fast": 3}})]), "shifts[0].providers.a.fast", "a mapping"),
    ],
)
def test_bad_spec_is_a_one_line_error_naming_file_and_key(spec, key, fragment, tmp_path):
    with pytest.raises(ConfigError) as info:
        synth_rounds(spec, "spec.yaml")
    message = str(info.value)
    assert message.startswith(f"spec.yaml: {key}: ") and fragment in message, message
    assert "\n" not in message
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = synth_cli(path, tmp_path / "out.jsonl")
    assert result.exit_code == 2
    assert result.output.strip() == f"Error: {path}: {message.removeprefix('spec.yaml: ')}"
    assert not (tmp_path / "out.jsonl").exists()


def test_unreadable_or_malformed_spec_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: 3\nrounds: 4\nproviders: {a: {}}\n")
    result = synth_cli(bad, tmp_path / "out.jsonl")
    assert result.exit_code == 2 and "bad.yaml: invalid YAML at line 2" in result.output
    assert "duplicate key 'rounds'" in result.output
    result = synth_cli(tmp_path / "missing.yaml", tmp_path / "out.jsonl")
    assert result.exit_code == 2 and "missing.yaml: cannot read spec" in result.output
    result = synth_cli(EXAMPLES / "no_shift.yaml", tmp_path / "no" / "such" / "dir.jsonl")
    assert result.exit_code == 2 and "cannot write traces" in result.output


def example(name, tmp_path):
    out = tmp_path / f"{name}.jsonl"
    result = synth_cli(EXAMPLES / f"{name}.yaml", out)
    assert result.exit_code == 0, result.output
    return load_rounds(out)


def test_each_example_spec_synthesises_and_parses(tmp_path):
    names = sorted(p.stem for p in EXAMPLES.glob("*.yaml"))
    assert names == [
        "no_shift",
        "shift_hedge_unhealthy",
        "shift_primary_queue",
        "shift_primary_slower",
    ]
    base = example("no_shift", tmp_path)
    shifted = {}
    for name in names:
        rounds = example(name, tmp_path)
        assert [r.round_id for r in rounds] == list(range(1, 301))
        assert all(set(r.arms) == {"runpod", "modal", "cerebrium"} for r in rounds)
        assert all(r.arms["runpod"].queue_delay_s is not None for r in rounds)
        assert all(r.arms[p].queue_delay_s is None for r in rounds for p in ("modal", "cerebrium"))
        assert rounds[:150] == base[:150]  # the shift starts at round 151
        shifted[name] = rounds[150:]
    assert shifted["no_shift"] == base[150:]
    for name, moved in (
        ("shift_primary_slower", "runpod"),
        ("shift_primary_queue", "runpod"),
        ("shift_hedge_unhealthy", "cerebrium"),
    ):
        for provider in ("runpod", "modal", "cerebrium"):
            same = [r.arms[provider] for r in shifted[name]] == [
                r.arms[provider] for r in base[150:]
            ]
            assert same == (provider != moved), (name, provider)


def test_example_shifts_do_what_their_names_say(tmp_path):
    def walls(rounds, provider):
        return [r.arms[provider].wall_s for r in rounds if r.arms[provider].valid]

    base = example("no_shift", tmp_path)[150:]
    slower = example("shift_primary_slower", tmp_path)[150:]
    assert nearest_rank(walls(slower, "runpod"), 0.5) > 2 * nearest_rank(walls(base, "runpod"), 0.5)
    assert nearest_rank(walls(slower, "runpod"), 0.95) > nearest_rank(walls(base, "runpod"), 0.95)
    queue = example("shift_primary_queue", tmp_path)[150:]
    warm = [r.arms["runpod"] for r in queue if r.arms["runpod"].wall_s < 60]
    assert warm and all((a.queue_delay_s or 0) >= 9 for a in warm)  # long queue, warm job
    unhealthy = example("shift_hedge_unhealthy", tmp_path)[150:]
    failed = sum(r.arms["cerebrium"].state is JobState.FAILED for r in unhealthy)
    assert failed > 3 * sum(r.arms["cerebrium"].state is JobState.FAILED for r in base)
