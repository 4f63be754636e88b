"""``gpuhedge-celery bench adaptive``: the adaptive policy against the static policies it replaces.

Per trace and adaptive policy, on the evaluation rounds (``round_id > calibration``): the adaptive
policy (learning calibration rounds whole, then only from its own races), the static policy with
the lowest J on the calibration rounds (what would have been deployed) and the one with the lowest
J on the evaluation rounds (hindsight). J = p95 s + 1000 x active USD per request; an infinite p95
gives J = inf (null in JSON). Static candidates: the replay's default sweep and a cutover grid.

JSON ``{"bench": "adaptive", "results": [...], "wall_s"}``; a row: trace, calibration, rounds,
policy, adaptive, calibration_static, hindsight_static (each: policy, J, p95_s, p50_s, active_usd,
billed_usd, misses_60s, hedged, n; calibration_static adds calibration_J), J_vs_hindsight,
J_vs_calibration_static (adaptive J / theirs), replay_wall_s, static_wall_s, static_candidates.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from ..commands.traces import BadInput, load_spec
from ..core import replay as rp
from ..core.adaptive import AdaptivePolicy
from ..core.policies import Policy, parse_policy
from ..core.replay import Round, RoundResult
from ..errors import ConfigError

DEADLINE_S = 60.0
USD_WEIGHT = 1000.0  # J = p95 s + USD_WEIGHT x active USD per request
SPEC_CAL = 100
_CAL = rp.CALIBRATION_LAST_ROUND
DEFAULT_POLICIES = ("adaptive:runpod->cerebrium,modal", "adaptive:runpod->cerebrium,modal@b0.2")
GRID_Q_S = (1.5, 2, 2.5, 3, 5, 10)
GRID_S_S = (8.5, 12, 20, 30)
MOSS = Path("tests/data/moss_rounds.jsonl")
SPECS = Path("config/traces")
REPO = Path(__file__).resolve().parents[2]
Trace = tuple[str, list[Round], int]  # name, rounds, last calibration round


def static_candidates(rounds: Sequence[Round]) -> list[Policy]:
    """The default sweep plus cutovers P->H@qQs+sSs from every queue-signal provider P."""
    found = {p.name: p for _, p in rp.default_policies(rounds)}
    for p in rp.queue_signal_providers(rounds):
        for h in (h for h in rp.providers_of(rounds) if h != p):
            for q, s in ((q, s) for q in GRID_Q_S for s in GRID_S_S if s >= q):
                policy = parse_policy(f"cutover:{p}->{h}@q{q:g}s+s{s:g}s")
                found.setdefault(policy.name, policy)
    return list(found.values())


def _num(value: float, digits: int) -> float | None:
    return None if math.isinf(value) else round(value, digits)


def figures(policy: Policy, results: Sequence[RoundResult]) -> dict[str, Any]:
    """``policy``'s J and its parts, per request, over ``results``."""
    s = rp.summarise_results(results, (DEADLINE_S,))
    return {
        "policy": policy.name,
        "J": _num(s.p95_s + USD_WEIGHT * s.active_usd, 4),
        "p95_s": _num(s.p95_s, 3),
        "p50_s": _num(s.p50_s, 3),
        "active_usd": round(s.active_usd, 6),
        "billed_usd": round(s.billed_usd, 6),
        "misses_60s": s.misses[DEADLINE_S],
        "hedged": s.hedged,
        "n": s.n,
    }


def _j(fig: dict[str, Any]) -> float:
    return math.inf if fig["J"] is None else float(fig["J"])


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 4)


def bench_trace(trace: Trace, policies: Sequence[AdaptivePolicy]) -> list[dict[str, Any]]:
    """One row per adaptive policy on ``trace``; the static candidates are replayed once."""
    name, rounds, cal = trace
    start = time.perf_counter()
    by_cal, by_eval = [], []
    for static in static_candidates(rounds):
        results = rp.replay_policy(static, rounds)
        by_cal.append(figures(static, [r for r in results if r.round_id <= cal]))
        by_eval.append(figures(static, [r for r in results if r.round_id > cal]))
    static_wall = time.perf_counter() - start
    chosen = min(range(len(by_cal)), key=lambda i: _j(by_cal[i]))
    deployed = {**by_eval[chosen], "calibration_J": by_cal[chosen]["J"]}
    hindsight = min(by_eval, key=_j)
    rows = []
    for policy in policies:
        start = time.perf_counter()
        results = rp.replay_policy(policy, rounds, None, cal)
        wall = time.perf_counter() - start
        adaptive = figures(policy, [r for r in results if r.round_id > cal])
        rows.append(
            {
                "trace": name,
                "calibration": cal,
                "rounds": len(rounds),
                "policy": policy.name,
                "adaptive": adaptive,
                "calibration_static": deployed,
                "hindsight_static": hindsight,
                "J_vs_hindsight": _ratio(adaptive["J"], hindsight["J"]),
                "J_vs_calibration_static": _ratio(adaptive["J"], deployed["J"]),
                "replay_wall_s": round(wall, 3),
                "static_wall_s": round(static_wall, 3),
                "static_candidates": len(by_eval),
            }
        )
    return rows


def _load(path: Path, is_spec: bool) -> list[Round]:
    if not is_spec:
        return rp.load_rounds(path)
    from ..providers.sim_traces import parse_spec, synth_rounds

    records = synth_rounds(parse_spec(load_spec(str(path)), str(path)))
    return rp.parse_rounds((json.dumps(r) for r in records), str(path))


def _arg(text: str, option: str, cal: int) -> tuple[Path, int]:
    """``PATH[:CAL]`` -> (path, CAL or ``cal``); a whole PATH that exists wins over a split one."""
    if Path(text).exists() or ":" not in text:
        return Path(text), cal
    path, _, tail = text.rpartition(":")
    try:
        return Path(path), int(tail)
    except ValueError:
        raise BadInput(f"bad {option} {text!r}: CAL after ':' must be an integer") from None


def _find(relative: Path) -> Path | None:
    """``relative`` under the current directory, else under the source checkout, else None."""
    return next((p for p in (relative, REPO / relative) if p.exists()), None)


def load_traces(
    traces: Sequence[str], specs: Sequence[str], policies: Sequence[Policy]
) -> list[Trace]:
    """The traces to bench (those given, else the defaults found on disk), checked."""
    wanted = [(*_arg(t, "--trace", _CAL), False) for t in traces]
    wanted += [(*_arg(s, "--spec", SPEC_CAL), True) for s in specs]
    defaults = not wanted
    if defaults and (moss := _find(MOSS)):
        wanted.append((moss, _CAL, False))
    if defaults and (found := _find(SPECS)):
        wanted += [(p, SPEC_CAL, True) for p in sorted(found.glob("*.yaml"))]
    if not wanted:
        raise BadInput(f"no traces: pass --trace or --spec (no {MOSS} or {SPECS}/*.yaml found)")
    out: list[Trace] = []
    for path, cal, is_spec in wanted:
        name = str(path)
        if not path.is_file():
            raise BadInput(f"{'--spec' if is_spec else '--trace'} {path}: no such file")
        try:
            rounds = _load(path, is_spec)
        except ConfigError as e:
            raise BadInput(str(e)) from None
        ids = [r.round_id for r in rounds]
        if not min(ids) <= cal < max(ids):
            raise BadInput(f"{name}: calibration {cal} leaves no calibration or evaluation rounds")
        for policy in policies:
            if missing := set(policy.providers()) - set(rp.providers_of(rounds)):
                raise BadInput(f"{name}: no {', '.join(sorted(missing))} for {policy.name}")
        out.append((name, rounds, cal))
    return out


def _f(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_text(rows: Sequence[dict[str, Any]], wall_s: float) -> str:
    """A block per row: the adaptive policy, the calibration-chosen and the hindsight static."""
    lines = []
    for row in rows:
        n = row["adaptive"]["n"]
        lines.append(f"{row['trace']}  calibration <= {row['calibration']}, evaluation n = {n}")
        for label in ("adaptive", "calibration_static", "hindsight_static"):
            fig = row[label]
            lines.append(
                f"  {label.split('_')[0]:<12}{fig['policy']:<46} J {_f(fig['J'], '7.2f')}  "
                f"p95 {_f(fig['p95_s'], '5.1f')} s  p50 {_f(fig['p50_s'], '5.1f')} s  "
                f"active ${fig['active_usd']:.4f}  billed ${fig['billed_usd']:.4f}  "
                f"miss>60s {fig['misses_60s']:>3}  hedged {fig['hedged']:>3}/{fig['n']}"
            )
        lines.append(
            f"  J / hindsight {_f(row['J_vs_hindsight'], '.3f')}, J / calibration-chosen "
            f"{_f(row['J_vs_calibration_static'], '.3f')}; replay {row['replay_wall_s']:.2f} s, "
            f"{row['static_candidates']} static candidates {row['static_wall_s']:.2f} s"
        )
    return "\n".join([*lines, f"bench wall {wall_s:.1f} s"])


TRACE_HELP = f"Traces PATH[:CAL], repeatable (CAL: last calibration round, default {_CAL})."
SPEC_HELP = f"Trace spec PATH[:CAL] synthesised in memory, repeatable (default CAL {SPEC_CAL})."
POLICY_HELP = f"Adaptive policy, repeatable (default: {', '.join(DEFAULT_POLICIES)})."


@click.command("adaptive")
@click.option("--trace", "traces", multiple=True, help=TRACE_HELP)
@click.option("--spec", "specs", multiple=True, help=SPEC_HELP)
@click.option("--policy", "policy_names", multiple=True, help=POLICY_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def command(
    traces: tuple[str, ...], specs: tuple[str, ...], policy_names: tuple[str, ...], as_json: bool
) -> None:
    """The adaptive policy's J on each trace's evaluation rounds beside the static policy chosen
    on its calibration rounds and the best static in hindsight (J = p95 s + 1000 x active $).
    Default traces: tests/data/moss_rounds.jsonl (CAL 18) and config/traces/*.yaml (CAL 100),
    from the current directory or the source checkout."""
    start = time.perf_counter()
    policies = []
    for name in policy_names or DEFAULT_POLICIES:
        try:
            policy = parse_policy(name)
        except ConfigError as e:
            raise BadInput(f"bad --policy {name!r}: {e}") from None
        if not isinstance(policy, AdaptivePolicy):
            raise BadInput(f"bad --policy {name!r}: expected adaptive:PRIMARY->HEDGE[,HEDGE...]")
        policies.append(policy)
    rows = [row for t in load_traces(traces, specs, policies) for row in bench_trace(t, policies)]
    wall = time.perf_counter() - start
    if as_json:
        click.echo(json.dumps({"bench": "adaptive", "results": rows, "wall_s": round(wall, 2)}))
    else:
        click.echo(format_text(rows, wall))
