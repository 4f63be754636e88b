"""``gpuhedge-celery demo --config FILE``: FILE's policy and budget caps on simulated providers,
end to end (the installed command in a subprocess, real Celery workers, a real or the embedded
Redis), and ``--redis-url`` / ``--config`` accepted before or after ``demo``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuhedge_celery.config import load_config, parse_config
from gpuhedge_celery.demo.config_run import simulated_config
from tests.support.fresh_imports import clean_env

ROOT = Path(__file__).resolve().parent.parent
CEREBRIUM = ROOT / "config" / "cerebrium.yaml"
DEAD_REDIS = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def gpuhedge(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpuhedge_celery", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(),
        cwd=str(ROOT),
    )


def old_caps(tmp_path: Path) -> Path:
    """config/cerebrium.yaml with max_usd_per_request $0.10 beside its 180 s attempt cap."""
    text = CEREBRIUM.read_text()
    cap = load_config(CEREBRIUM).budget.max_usd_per_request
    old = text.replace(f"max_usd_per_request: {cap:g}", "max_usd_per_request: 0.10")
    assert old != text and "attempt_cap_s: 180" in old
    path = tmp_path / "cerebrium-old-caps.yaml"
    path.write_text(old)
    return path


def test_the_simulated_copy_keeps_every_figure_but_the_adapters():
    cfg = load_config(CEREBRIUM)
    data, notes = simulated_config(cfg)
    sim = parse_config(data, source="simulated")
    assert notes == [] and sim.time_scale < cfg.time_scale
    assert list(sim.providers) == list(cfg.providers)
    for name, p in cfg.providers.items():
        s = sim.provider(name)
        assert s.adapter == "sim" and (s.role, s.deployed) == (p.role, p.deployed)
        assert (s.billed_rate_per_s, s.idle_billed_seconds) == (
            p.billed_rate_per_s,
            p.idle_billed_seconds,
        )
        assert sim.cap_s(name) == cfg.cap_s(name)
    assert sim.budget == cfg.budget and sim.policy == cfg.policy
    assert sim.validator == cfg.validator and sim.slo_deadlines_s == cfg.slo_deadlines_s
    assert sim.make_policy().providers() == cfg.make_policy().providers()


@pytest.mark.redis
@pytest.mark.celery
def test_the_cerebrium_preset_hedges_and_the_budget_refuses_nothing(redis_url):
    done = gpuhedge("demo", "--config", str(CEREBRIUM), "--redis-url", redis_url,
                    "--races", "4", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["redis"] != "embedded fakeredis (simulated Redis)"  # the real Redis, as told
    assert report["warnings"] == [] and report["budget_refusals"] == 0
    assert report["hedges_launched"] >= 1 and len(report["races"]) == 4
    for race in report["races"]:
        assert race["budget_refused"] == [] and not race["leaked"]
        assert race["hedge_launched"] == race["primary_slow"], race
        if race["hedge_launched"]:
            assert race["winner"] == "cerebrium" and race["winner_role"] == "hedge"
            (loser,) = race["losers"]
            assert loser["provider"] == "runpod" and loser["evidence"]
        else:
            assert race["winner"] == "runpod" and race["losers"] == []
    text = done.stderr
    assert "hedge cerebrium (simulated) launched at " in text
    assert "loser runpod (primary, simulated): " in text
    assert "0 attempt(s) refused by the budget" in text
    assert report["cleanup"]["deleted"] > 0


@pytest.mark.redis
@pytest.mark.celery
def test_the_old_caps_refuse_every_hedge(redis_url, tmp_path):
    # --redis-url and --config before `demo` this time: both positions are accepted
    path = old_caps(tmp_path)
    done = gpuhedge("--redis-url", redis_url, "--config", str(path), "demo",
                    "--races", "3", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["config"] == str(path) and report["hedges_launched"] == 0
    slow = [r for r in report["races"] if r["primary_slow"]]
    assert slow and report["budget_refusals"] == len(slow)
    for race in slow:
        (refusal,) = race["budget_refused"]
        assert refusal.startswith("hedge cerebrium: budget: refused by max_usd_per_request")
        assert race["winner"] == "runpod"  # the slow primary won alone: the tail it was for
    (warning,) = report["warnings"]
    assert "forbids the hedge attempt (cerebrium)" in warning
    assert "WARNING: budget.max_usd_per_request $0.1 forbids" in done.stderr


@pytest.mark.celery
def test_on_the_embedded_redis_by_default_the_providers_are_named_simulated():
    done = gpuhedge("demo", "--config", str(CEREBRIUM), "--races", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "Redis: embedded fakeredis (simulated Redis)" in out
    assert "primary  runpod (simulated): worst case 180 s x $0.000306/s" in out
    assert "race 1 (" in out and "hedge cerebrium (simulated) launched" in out
    assert "winner cerebrium (hedge, simulated)" in out and out.rstrip().endswith(" s")


@pytest.mark.parametrize(
    "args",
    [["demo", "--redis-url", DEAD_REDIS], ["--redis-url", DEAD_REDIS, "demo"]],
    ids=["after-demo", "before-demo"],
)
def test_demo_takes_redis_url_before_or_after_demo(args):
    done = gpuhedge(*args, timeout=60)
    assert "No such option" not in done.stderr
    assert done.returncode == 3, done.stderr  # the Redis named was tried: unreachable
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: Redis at {DEAD_REDIS} is unreachable"), line


def test_demo_config_refuses_a_missing_or_empty_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    done = gpuhedge("demo", "--config", str(missing), timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {missing}: config file not found (from demo --config)"
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    done = gpuhedge("demo", "--config", str(empty), timeout=60)
    assert done.returncode == 2 and done.stderr.strip().startswith(f"error: {empty}: providers: ")
