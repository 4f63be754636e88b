"""The custom-policy example in docs/policies.md runs exactly like a built-in."""

from __future__ import annotations

import pathlib
import re

import pytest

from gpuhedge_celery.core.policies import parse_policy
from gpuhedge_celery.core.race import Race
from gpuhedge_celery.core.scripted import Arm, run_race

DOC = pathlib.Path(__file__).parent.parent / "docs" / "policies.md"


@pytest.fixture(scope="module")
def slowstart():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    [example] = [b for b in blocks if "register_policy" in b and "class " in b]
    namespace: dict = {}
    exec(compile(example, str(DOC), "exec"), namespace)  # registers kind "slowstart"
    return namespace["HedgeOnSlowStart"]


def test_documented_custom_policy_hedges_on_a_queued_primary(slowstart):
    policy = parse_policy("slowstart:p->h")
    assert isinstance(policy, slowstart) and policy.name == "slowstart:p->h"
    race = run_race(policy, {"p": Arm("p", 90, queue_delay_s=20), "h": Arm("h", 10)})
    assert race.winner_attempt.provider == "h" and race.latency() == pytest.approx(11.0)
    assert race.attempt_for("primary").receipt is not None  # the loser was cancelled


def test_documented_custom_policy_keeps_a_running_primary_and_resumes(slowstart):
    policy = parse_policy("slowstart:p->h")
    race = run_race(policy, {"p": Arm("p", 6, queue_delay_s=0.5), "h": Arm("h", 10)})
    assert [a.provider for a in race.attempts] == ["p"] and race.latency() == pytest.approx(6)
    clone = Race.from_dict(race.to_dict(), race.clock)
    assert clone.policy == policy and clone.to_dict() == race.to_dict()
