"""``gpuhedge-celery demo --config FILE``: a config's own policy and budget on simulated providers.

Every provider of FILE is stood in by a ``sim`` provider of the same name, role, rate, idle
window and cap; the policy, its timers, the SLO, the attempt caps and every budget cap are
FILE's. The simulated primary is slow in about half the races (seeded, the same on every run),
slow enough that the policy's hedge launches; the other providers answer in a few seconds.
Simulated time runs 10x faster than the wall clock. Nothing is sent to any provider and no
account is needed; the races, reservations and receipts are the real ones, on real Celery
workers and the embedded Redis (or ``--redis-url``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .. import settings as process_settings
from ..core.budget import REFUSED_PREFIX

Echo = Callable[[str], None]

SCALE = 0.1  # simulated time runs 10x faster than the wall clock (or the file's, if faster)
SEED = 22  # slow primaries on keys 0, 2 and 5 of the first six: the first race hedges
SLOW_PROBABILITY = 0.5
# Validators that can check the simulator's payload (a base64 WAV); any other becomes wav.
SIM_VALIDATORS = ("wav", "nonempty")


@dataclass
class ConfigDemoReport:
    """What ``demo --config`` measured, for ``--json`` and the tests."""

    config: str
    redis: str
    prefix: str = ""
    policy: str = ""
    warnings: list[str] = field(default_factory=list)
    races: list[dict[str, Any]] = field(default_factory=list)
    hedges_launched: int = 0
    budget_refusals: int = 0
    cleanup: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0


def _fast(cap_s: float) -> dict[str, Any]:
    """A few seconds, always well inside the attempt's cap."""
    return {"queue_s": [0.3, 0.8], "run_s": [min(3.0, 0.3 * cap_s), min(6.0, 0.4 * cap_s)]}


def _slow(cap_s: float) -> dict[str, Any]:
    """Running (not queued) by any cutover poll, and still running long after any hedge timer."""
    return {"queue_s": [0.3, 0.8], "run_s": [0.5 * cap_s, 0.7 * cap_s]}


def _audio(validator: Any) -> dict[str, Any]:
    """Simulated audio that the configured wav validator's options accept."""
    options = dict(validator.options) if validator.name == "wav" else {}
    seconds = max(1.0, float(options.get("min_s") or 0.0))
    if options.get("max_s"):
        seconds = min(seconds, float(options["max_s"]))
    return {"seconds": seconds, "sample_rate": int(options.get("sample_rate") or 16_000)}


def simulated_config(cfg: Any) -> tuple[dict[str, Any], list[str]]:
    """FILE's config with every provider a ``sim`` stand-in (the YAML data), and notes on what
    had to change beyond the adapters."""
    notes: list[str] = []
    validator = cfg.validator
    if validator.name not in SIM_VALIDATORS:
        notes.append(
            f"validator {validator.name!r} cannot check simulated audio: the demo uses wav"
        )
    providers: dict[str, Any] = {}
    for name, p in cfg.providers.items():
        cap = cfg.cap_s(name)
        sim: dict[str, Any] = {"seed": SEED, "fast": _fast(cap), "audio": _audio(validator)}
        sim["cancel"] = {"ack_s": 0.3, "terminal_s": 0.5}
        if p.role == "primary":
            sim.update(slow_probability=SLOW_PROBABILITY, slow=_slow(cap))
        entry: dict[str, Any] = {
            "role": p.role,
            "adapter": "sim",
            "billed_rate_per_s": p.billed_rate_per_s,
            "idle_billed_seconds": p.idle_billed_seconds,
            "deployed": p.deployed,
            "sim": sim,
        }
        if p.gpu:
            entry["gpu"] = p.gpu
        if p.timeout_s is not None:
            entry["timeout_s"] = p.timeout_s
        providers[name] = entry
    data: dict[str, Any] = {
        "time_scale": min(cfg.time_scale, SCALE),  # a compressed file stays as compressed
        "providers": providers,
        "policy": {"name": cfg.policy.name, "params": dict(cfg.policy.params)},
        "slo": {"deadlines_s": list(cfg.slo_deadlines_s)},
        "timeouts": {"attempt_cap_s": cfg.attempt_cap_s},
        "budget": _budget(cfg.budget),
        "validator": (
            {"name": validator.name, **dict(validator.options)}
            if validator.name in SIM_VALIDATORS
            else "wav"
        ),
    }
    if cfg.race_deadline_s is not None:
        data["timeouts"]["race_deadline_s"] = cfg.race_deadline_s
    return data, notes


def _budget(caps: Any) -> dict[str, Any]:
    found = {k: v for k, v in caps.to_dict().items() if v not in (None, {})}
    for scoped in ("providers", "keys"):
        if scoped in found:
            found[scoped] = {
                name: {k: v for k, v in cap.items() if v is not None}
                for name, cap in found[scoped].items()
            }
    return found


def _is_amount(value: Any) -> bool:
    """A dollar cap of the budget block (its other fields are keys, names and per-scope caps)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _refusals(receipt: dict[str, Any]) -> list[str]:
    return [
        f"{a['role']} {a['provider']}: {reason}"
        for a in receipt.get("attempts", [])
        for reason in a.get("reasons") or []
        if reason.startswith(REFUSED_PREFIX)
    ]


def _launched_at(attempt: dict[str, Any], scale: float) -> float | None:
    for t, label in attempt.get("timeline") or []:
        if label == "launched":
            return t / scale
    return None


def race_summary(receipt: dict[str, Any], scale: float, primary_slow: bool) -> dict[str, Any]:
    """One race's outcome from its receipt: the hedge, the winner, each loser's cancel."""
    attempts = receipt.get("attempts", [])
    sent = [a for a in attempts if a.get("sent") is not False]
    hedges = [a for a in sent if a["role"] != "primary"]
    winner = next((a for a in attempts if a["id"] == receipt.get("winner")), None)
    losers = []
    for a in sent:
        if winner is not None and a["id"] == winner["id"]:
            continue
        c = a.get("cancel_receipt") or {}
        losers.append(
            {
                "provider": a["provider"],
                "role": a["role"],
                "state": a.get("state"),
                "evidence": c.get("evidence"),
                "terminal_status": c.get("terminal_status"),
                "execution_s_before_cancel": (c.get("execution_ms_before_cancel") or 0) / 1000,
                "estimated_cost_usd": c.get("estimated_cost_usd"),
                "leaked": c.get("leaked"),
            }
        )
    latency = receipt.get("latency_ms")
    return {
        "race_id": receipt.get("race_id"),
        "primary_slow": primary_slow,
        "hedge_launched": bool(hedges),
        "hedges": [
            {"provider": a["provider"], "role": a["role"], "at_s": _launched_at(a, scale)}
            for a in hedges
        ],
        "budget_refused": _refusals(receipt),
        "winner": winner["provider"] if winner else None,
        "winner_role": winner["role"] if winner else None,
        "latency_s": None if latency is None else latency / 1000 / scale,
        "losers": losers,
        "wasted_usd": receipt.get("wasted_usd"),
        "leaked": bool(receipt.get("leaked")),
    }


def _echo_race(n: int, race: dict[str, Any], echo: Echo) -> None:
    speed = "slow" if race["primary_slow"] else "fast"
    parts = [f"primary {speed}"]
    for h in race["hedges"]:
        at = "" if h["at_s"] is None else f" at {h['at_s']:.1f} s"
        parts.append(f"{h['role']} {h['provider']} (simulated) launched{at}")
    if race["budget_refused"]:
        parts.append(f"{len(race['budget_refused'])} attempt(s) REFUSED by the budget")
    if race["winner"]:
        who = f"{race['winner']} ({race['winner_role']}, simulated)"
        parts.append(f"winner {who} at {race['latency_s']:.1f} s")
    else:
        parts.append("no winner")
    echo(f"  race {n} ({(race['race_id'] or '')[:12]}): " + "; ".join(parts))
    for line in race["budget_refused"]:
        echo(f"      refused: {line}")
    for x in race["losers"]:
        cost = x["estimated_cost_usd"]
        echo(
            f"      loser {x['provider']} ({x['role']}, simulated): {x['state'] or '-'}, evidence "
            f"{x['evidence'] or '-'}, terminal {x['terminal_status'] or '-'}, "
            f"ran {x['execution_s_before_cancel']:.1f} s before the cancel, "
            f"est. {'-' if cost is None else f'${cost:.4f}'}, leaked {str(x['leaked']).lower()}"
        )


def run_config_demo(
    redis_url: str, *, embedded: bool, config_path: str, races: int, echo: Echo
) -> ConfigDemoReport:
    """Start a coordination worker on the simulated copy of ``config_path``, run ``races``
    races with its policy and caps, and report each one's hedge, winner and loser."""
    from ..config import cap_warnings, load_config, planned_attempts
    from ..settings import redact_url
    from .cleanup import clean_up
    from .run import demo_env, final_receipt
    from .workers import LocalWorkers

    t0 = time.monotonic()
    source = load_config(config_path)
    data, notes = simulated_config(source)
    folder = Path(tempfile.mkdtemp(prefix="gpuhedge-demo-config-"))
    path = folder / f"simulated-{Path(config_path).name}"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    cfg = load_config(path)
    policy = cfg.make_policy()
    kind = "embedded fakeredis (simulated Redis)" if embedded else redact_url(redis_url)
    prefix = f"democfg{os.getpid()}"
    report = ConfigDemoReport(config=config_path, redis=kind, prefix=prefix, policy=policy.name)
    report.warnings = [w.text() for w in cap_warnings(cfg)]

    echo(f"Config {config_path}: its policy, timeouts and budget caps, every provider simulated")
    fast = 1 / cfg.time_scale
    echo(f"  (sim adapter: no account, nothing billed; simulated time runs {fast:g}x fast)")
    echo(f"  policy {source.make_policy().name}")
    for a in planned_attempts(cfg, policy):
        echo(
            f"  {a.role:<8} {a.provider} (simulated): worst case {a.arithmetic().split(' ', 2)[2]}"
        )
    budget = ", ".join(f"{k} ${v:g}" for k, v in data["budget"].items() if _is_amount(v))
    echo(f"  budget: {budget or 'no caps'}")
    for note in notes:
        echo(f"  note: {note}")
    for line in report.warnings:
        echo(f"  WARNING: {line}")
    primary = policy.providers()[0]
    if len(policy.providers()) == 1:
        echo(f"  policy {policy.kind} races one provider: there is no hedge to launch")
    echo(
        f"  the simulated {primary} is slow in about half the races (seed {SEED}), so the "
        "policy's hedge launches in those"
    )
    echo(f"Redis: {kind}; key prefix {prefix}")

    env = demo_env(redis_url, prefix)
    env["GPUHEDGE_CONFIG"] = str(path)
    os.environ.update({k: v for k, v in env.items() if k.startswith("GPUHEDGE_")})
    process_settings.reload()  # this process's tasks run with the demo's settings too
    workers = LocalWorkers(env)
    workers.start("coord")
    try:
        from ..store.connection import client_for
        from ..store.races import RaceStore
        from ..tasks.races import hedged_infer

        shards = process_settings.current().race_shards(prefix, redis_url)
        store = RaceStore(client_for(redis_url), shards)
        workers.wait_ready()
        echo(f"coordination worker ready after {time.monotonic() - t0:.1f} s\n")
        echo(f"== {races} races, all in flight at once (times in simulated seconds) ==")
        slow = {i: cfg.build(primary).draw(str(i))["slow"] for i in range(races)}
        sent = [
            hedged_infer.apply_async(({"sim_key": i, "text": f"config demo {i}"},))
            for i in range(races)
        ]
        wait_s = cfg.race_deadline_for(policy.providers()) * cfg.time_scale + 30
        for i, res in enumerate(sent):
            try:
                res.get(timeout=wait_s, propagate=False)
            except Exception as e:  # a race that did not finish is worth showing, not hiding
                echo(f"  race {i + 1} ({res.id[:12]}) did not finish: {type(e).__name__}: {e}")
            race = race_summary(final_receipt(store, res.id), cfg.time_scale, slow[i])
            report.races.append(race)
            _echo_race(i + 1, race, echo)
    finally:
        workers.stop()
        shutil.rmtree(folder, ignore_errors=True)
        if not embedded:
            celery_redis = process_settings.current().glue.results_url
            report.cleanup = clean_up(redis_url, prefix, celery_redis)
    report.hedges_launched = sum(1 for r in report.races if r["hedge_launched"])
    report.budget_refusals = sum(len(r["budget_refused"]) for r in report.races)
    wins: dict[str, int] = {}
    for r in report.races:
        wins[r["winner"] or "none"] = wins.get(r["winner"] or "none", 0) + 1
    echo(
        f"\n{races} races: a hedge launched in {report.hedges_launched}, "
        f"{report.budget_refusals} attempt(s) refused by the budget; winners "
        + ", ".join(f"{k} {v}" for k, v in wins.items())
    )
    if report.budget_refusals:
        echo("  the budget refused attempts the policy launched: raise the cap that refused them")
        echo(
            "  or lower an attempt's worst case (`gpuhedge-celery config check FILE` shows the sum)"
        )
    report.wall_s = time.monotonic() - t0
    return report
