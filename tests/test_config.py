"""Config loading: lookup order, typed results, one-line errors naming file, key and expectation."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuhedge_celery.config import (
    GpuHedgeConfig,
    find_config,
    load_config,
    packaged_path,
    parse_config,
    parse_config_text,
)
from gpuhedge_celery.core.clock import VirtualClock
from gpuhedge_celery.core.jobs import JobState
from gpuhedge_celery.core.validators import validate
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.providers import build_provider, known_adapters, register_adapter
from gpuhedge_celery.providers.base import Provider
from gpuhedge_celery.providers.sim import MemoryLedger, SimProvider

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = "providers:\n  p: {adapter: sim}\n"


def test_lookup_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_config() == packaged_path("default.yaml")
    (tmp_path / "config").mkdir()
    local = tmp_path / "config" / "gpuhedge.yaml"
    local.write_text(MINIMAL)
    assert find_config() == Path.cwd() / "config" / "gpuhedge.yaml"
    explicit = tmp_path / "mine.yaml"
    explicit.write_text(MINIMAL.replace("p:", "q:"))
    assert find_config(explicit) == explicit
    assert list(load_config(explicit).providers) == ["q"]
    assert list(load_config().providers) == ["p"]
    assert list(load_config(cwd=ROOT / "docs").providers) == ["sim-cheap", "sim-steady",
                                                               "sim-reserve"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"^nope\.yaml: config file not found"):
        find_config("nope.yaml")


def test_packaged_default_is_typed():
    cfg = load_config(packaged_path("default.yaml"))
    assert isinstance(cfg, GpuHedgeConfig)
    assert [p.name for p in cfg.by_role("primary")] == ["sim-cheap"]
    assert cfg.policy.name == "fixed" and cfg.policy.params == {"hedge_after_ms": 10000}
    assert cfg.slo_deadlines_s == (30.0, 60.0) and cfg.attempt_cap_s == 180.0
    assert cfg.validator.name == "wav" and cfg.time_scale == 1.0
    cheap = cfg.provider("sim-cheap")
    assert cheap.billed_rate_per_s == 0.000306 and cheap.idle_billed_seconds == 60.0
    assert cfg.cap_s("sim-cheap") == 180.0
    with pytest.raises(ConfigError, match="no provider 'x' .known: sim-cheap, sim-steady"):
        cfg.provider("x")
    with pytest.raises(ConfigError, match="no packaged config 'x.yaml'"):
        packaged_path("x.yaml")


def test_demo_config_seeds_show_each_scenario():
    """The scenario table in demo.yaml's header comment is what the draws produce."""
    cfg = load_config(packaged_path("demo.yaml"))
    assert cfg.time_scale == 0.1
    assert cfg.scaled_policy_params() == {
        "queue_cutover_ms": 250.0,
        "safety_hedge_ms": 850.0,
        "escalate_after_ms": 2500.0,
    }
    sims = [n for n, p in cfg.providers.items() if p.adapter == "sim"]
    built = {n: cfg.build(n, clock=VirtualClock(0.0), ledger=MemoryLedger()) for n in sims}
    fates = {n: [p.draw(str(k)) for k in range(20)] for n, p in built.items()}  # type: ignore[attr-defined]
    cheap, steady, reserve = fates["sim-cheap"], fates["sim-steady"], fates["sim-reserve"]

    def total(d):
        return d["queue_s"] + d["run_s"]

    # 0: fast valid primary
    assert not cheap[0]["slow"] and cheap[0]["outcome"] == "ok" and total(cheap[0]) < 10
    # 1: slow primary; the hedge launched at 10 s answers long before it
    assert cheap[1]["slow"] and 10 + total(steady[1]) < total(cheap[1]) - 30
    assert steady[1]["outcome"] == "ok"
    # 2: fast but invalid primary, valid hedge
    assert cheap[2]["outcome"] == "invalid" and steady[2]["outcome"] == "ok"
    # 3: primary still queued at the 2.5 s cutover; hedge fine
    assert cheap[3]["queue_s"] > 2.5 and steady[3]["outcome"] == "ok" and not steady[3]["slow"]
    # 4: primary queued at cutover, the hedge launched then is still queued at 25 s: escalate
    assert cheap[4]["queue_s"] > 2.5 and 2.5 + steady[4]["queue_s"] > 25
    assert reserve[4]["outcome"] == "ok" and total(reserve[4]) < 15
    # the invalid primary's payload really fails the configured validator
    p = built["sim-cheap"]
    r = p.result(p.submit({"sim_key": 2}), cap_s=cfg.cap_s("sim-cheap"))
    assert r.state is JobState.COMPLETED
    assert not validate(cfg.validator.name, r.payload, **cfg.validator.options)
    assert r.wall_ms == pytest.approx(total(cheap[2]) * 1000 * cfg.time_scale, abs=1)


def test_example_configs_load(monkeypatch):
    for path in sorted((ROOT / "config").glob("*.yaml")):
        cfg = load_config(path)
        assert cfg.by_role("primary"), path


BAD = [
    # (yaml, key in the message, fragment)
    ("providers:\n  p: {adapter: sim, billed_rate_per_s: cheap}\n",
     "providers.p.billed_rate_per_s", "expected a number >= 0, got 'cheap'"),
    ("providers:\n  p: {adapter: sim, billed_rate_per_s: -1}\n",
     "providers.p.billed_rate_per_s", "expected a number >= 0, got -1"),
    ("providers:\n  p: {adapter: sim, biled_rate_per_s: 1}\n",
     "providers.p.biled_rate_per_s", "unknown key; did you mean 'billed_rate_per_s'?"),
    ("providers:\n  p: {adapter: sim, role: backup}\n",
     "providers.p.role", "expected one of primary, hedge, fallback, got 'backup'"),
    ("providers:\n  p: {adapter: sim, deployed: maybe}\n",
     "providers.p.deployed", "expected true or false"),
    ("providers:\n  p: {adapter: modal9}\n",
     "providers.p.adapter", "unknown adapter 'modal9'"),
    ("providers:\n  p: {role: primary}\n", "providers.p.adapter", "required key is missing"),
    ("providers:\n  p: {adapter: sim, role: hedge}\n", "providers",
     "expected at least one provider with role: primary"),
    ("providers:\n  'p q': {adapter: sim}\n", "providers.p q", "expected a provider name"),
    ("providers:\n  p: {adapter: http, http: {base_url: x}}\n",
     "providers.p.http.submit.url", "required key is missing"),
    ("providers:\n  p: [1, 2]\n", "providers.p", "expected a mapping"),
    (MINIMAL + "policy: {name: fastest}\n", "policy.name",
     "or 'package.module:kind', got 'fastest'"),
    (MINIMAL + "policy: {name: fixed}\n", "policy.name",
     "policy 'fixed' needs a deployed provider with role: hedge"),
    (MINIMAL + "policy: {name: single, params: {primary: q}}\n", "policy.params.primary",
     "expected a provider name (p), got 'q'"),
    (MINIMAL + "policy: {name: 'no_such_pkg.mod:mine'}\n", "policy.name",
     "cannot import policy module 'no_such_pkg.mod'"),
    (MINIMAL + "policy: {name: fixed, params: {hedge_after: 5}}\n", "policy.params.hedge_after",
     "unknown key; did you mean 'hedge_after_ms'?"),
    (MINIMAL + "policy: {name: fixed, params: {hedge_after_ms: -5}}\n",
     "policy.params.hedge_after_ms", "expected milliseconds >= 0"),
    (MINIMAL + "slo: {deadlines_s: 60}\n", "slo.deadlines_s", "expected a non-empty list"),
    (MINIMAL + "timeouts: {attempt_cap_s: 0}\n", "timeouts.attempt_cap_s", "expected a number > 0"),
    (MINIMAL + "budget: {max_usd: 1}\n", "budget.max_usd", "unknown key"),
    (MINIMAL + "validator: wave\n", "validator", "unknown validator 'wave'"),
    (MINIMAL + "validator: {name: wav, rate: 1}\n", "validator", "bad options for validator"),
    (MINIMAL + "polcy: {name: fixed}\n", "polcy", "unknown key; did you mean 'policy'?"),
    (MINIMAL + "time_scale: fast\n", "time_scale", "expected a number > 0"),
]  # fmt: skip


@pytest.mark.parametrize("text,key,fragment", BAD, ids=[b[1] + ":" + b[2][:20] for b in BAD])
def test_errors_are_one_line_with_file_and_key(text, key, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config_text(text, source="conf/x.yaml")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"conf/x.yaml: {key}: "), message
    assert fragment in message, message
    assert info.value.file == "conf/x.yaml" and info.value.key == key


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("providers:\n  p: {adapter: sim\n", "invalid YAML at line"),
        ("providers:\n  p: {adapter: sim}\n  p: {adapter: sim}\n", "duplicate key 'p'"),
        ("- just\n- a list\n", "expected a mapping"),
    ],
)
def test_yaml_level_errors_name_the_file(text, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config_text(text, source="y.yaml")
    message = str(info.value)
    assert message.startswith("y.yaml: ") and fragment in message and "\n" not in message


@pytest.mark.parametrize("text", ["", "validator: wav\n", "providers: {}\n", "providers:\n"])
def test_a_file_without_providers_is_refused(text):
    # an empty file (a config map mounted empty) would start workers that fail every race
    with pytest.raises(ConfigError) as info:
        parse_config_text(text, source="e.yaml")
    assert str(info.value) == (
        "e.yaml: providers: empty: expected at least one provider with role: primary"
    )


def test_a_minimal_file_gives_defaults():
    cfg = parse_config_text("providers: {p: {adapter: sim, role: primary}}\n", source="e.yaml")
    assert cfg.policy.name == "single" and cfg.validator.name == "nonempty"


def test_repr_hides_adapter_secrets():
    cfg = parse_config({"providers": {"p": {"adapter": "http", "http": {
        "base_url": "https://x", "headers": {"authorization": "sk-live-abcdef"},
        "submit": {"url": "/run", "job_id": "id"},
        "status": {"url": "/s/{job_id}", "state": "status"},
        "cancel": {"url": "/c/{job_id}"}}}}, "budget": {"ceiling_usd": 100}})  # fmt: skip
    assert "sk-live-abcdef" not in repr(cfg)
    assert "sk-live-abcdef" not in repr(cfg.provider("p"))


class EchoProvider(Provider):
    """A minimal custom adapter: proves adapters plug in through the registry."""

    adapter = "echo"
    spends_money = False  # bills nobody: a config of echo providers needs no budget ceiling

    def submit(self, request):  # pragma: no cover - not exercised here
        raise NotImplementedError

    status = result = cancel = submit


def test_custom_adapters_plug_in_by_name_or_path():
    register_adapter("test-echo", EchoProvider)
    assert "test-echo" in known_adapters()
    cfg = parse_config({"providers": {"e": {"adapter": "test-echo", "billed_rate_per_s": 0.5}}})
    built = cfg.build("e")
    assert isinstance(built, EchoProvider) and built.billed_rate_per_s == 0.5
    path = "tests.test_config:EchoProvider"
    assert isinstance(build_provider("e2", {"adapter": path}), EchoProvider)
    with pytest.raises(ConfigError, match="unknown key"):
        parse_config({"providers": {"e": {"adapter": "test-echo", "test-echo": {"x": 1}}}})
    with pytest.raises(ConfigError, match="cannot import adapter 'nowhere:Thing'"):
        build_provider("e3", {"adapter": "nowhere:Thing"})


def test_build_provider_from_raw_mapping():
    p = build_provider("s", {"adapter": "sim", "sim": {"seed": 3}}, clock=VirtualClock(0.0))
    assert isinstance(p, SimProvider) and p.spec.seed == 3 and p.name == "s"


def test_make_policy_builds_engine_policies_from_roles_and_scaled_params():
    default = load_config(packaged_path("default.yaml"))
    assert default.make_policy().name == "hedge:sim-cheap->sim-steady@10s"
    assert default.make_policy("state_aware").name == ("cutover:sim-cheap->sim-steady@q2.5s+s8.5s")
    assert default.make_policy("single").name == "single:sim-cheap"
    assert default.make_policy("hedge:a->b@5s").name == "hedge:a->b@5s"
    demo = load_config(packaged_path("demo.yaml"))
    cascade = demo.make_policy()
    assert cascade.params() == {
        "primary": "sim-cheap",
        "hedge": "sim-steady",
        "fallback": "sim-reserve",
        "queue_cutover_ms": 250,
        "safety_hedge_ms": 850,
        "escalate_after_ms": 2500,
    }
    assert demo.make_policy("fixed").params()["hedge_after_ms"] == 1000  # default, scaled
    with pytest.raises(ConfigError, match="expected one of"):
        demo.make_policy("fastest")


def test_policy_params_may_pick_providers_and_default_policy_follows_roles():
    cfg = parse_config_text(
        "providers:\n  a: {adapter: sim}\n  b: {adapter: sim, role: hedge}\n"
        "  c: {adapter: sim, role: hedge}\n"
        "policy: {name: fixed, params: {hedge: c, hedge_after_ms: 3000}}\n"
    )
    assert cfg.make_policy().name == "hedge:a->c@3s"
    assert parse_config_text(MINIMAL).policy.name == "single"
    assert parse_config_text(MINIMAL + "  h: {adapter: sim, role: hedge}\n").policy.name == "fixed"
