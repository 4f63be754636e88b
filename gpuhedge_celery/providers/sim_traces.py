"""Synthetic paired-round traces with regime shifts, drawn with the ``sim`` adapter's own fates.

A spec (a mapping, as YAML loads it)::

    rounds: 300
    seed: 7
    providers:            # each a sim block as the sim adapter takes it (simspec.py)
      runpod: {slow_probability: 0.3, fast: {queue_s: [1.1, 1.3], run_s: [4.4, 5.2]}}
      modal: {fast: {run_s: [26, 43]}, queue_signal: false}
    shifts:               # from at_round on, the named providers' blocks change
      - at_round: 151
        providers: {runpod: {slow: {run_s: [150, 180]}}}

Round ``r`` of provider ``p`` is ``SimSpec.draw("<p>:<r>")`` under the block in force at ``r``
(its seed is the spec's ``seed`` unless the block sets its own), so a provider's draws depend
on nothing but the seed, its name, the round and its own blocks. A shift's block is merged over
the provider's base block (nested mappings key by key) and stays in force until a later shift
names the provider. The arm's ``wall_s`` is queue_s + run_s in provider seconds; ``ok`` is a
valid COMPLETED, ``invalid`` an invalid COMPLETED, ``failed`` FAILED; ``metrics.queue_delay_ms``
is the queue time unless the block says ``queue_signal: false``. Keys that only shape a live
sim (time_scale, cancel, audio, poll_s, reports_queue_state) are accepted and change nothing.
"""

from __future__ import annotations

import bisect
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..core.stats import nearest_rank
from .options import Block
from .simspec import SimSpec

STAGE = "synth"
MAX_ROUNDS = 1_000_000


@dataclass(frozen=True)
class Regime:
    """A provider's block in force from ``from_round`` on."""

    from_round: int
    spec: SimSpec
    queue_signal: bool


@dataclass(frozen=True)
class TraceSpec:
    """A validated spec: round count, seed, and each provider's regimes in round order."""

    rounds: int
    seed: int
    regimes: Mapping[str, tuple[Regime, ...]]
    shift_rounds: tuple[int, ...]  # distinct at_round values, ascending

    @property
    def providers(self) -> list[str]:
        return list(self.regimes)

    def regime(self, provider: str, round_id: int) -> Regime:
        regimes = self.regimes[provider]
        starts = [r.from_round for r in regimes]
        return regimes[bisect.bisect_right(starts, round_id) - 1]


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base``: nested mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _regime(block: Block, from_round: int, seed: int) -> Regime:
    queue_signal = block.boolean("queue_signal", True)
    spec = SimSpec.from_block(block)  # takes the block's other keys, and refuses unknown ones
    if not block.has("seed"):
        spec = replace(spec, seed=seed)
    return Regime(from_round, spec, queue_signal)


def parse_spec(data: Any, source: str = "<spec>") -> TraceSpec:
    """Validate a spec mapping; a one-line :class:`ConfigError` naming ``source`` and the key."""
    root = Block(data, "", source)
    rounds = root.number("rounds", integer=True, minimum=1, maximum=MAX_ROUNDS)
    seed = root.number("seed", 0, integer=True)
    providers = root.mapping("providers")
    if not providers.data:
        raise root.error("providers", "expected at least one provider block")
    base: dict[str, Mapping[str, Any]] = {}
    regimes: dict[str, list[Regime]] = {}
    for name in providers.data:
        if not isinstance(name, str) or not name:
            raise providers.error(str(name), "expected a provider name (a non-empty string)")
        block = providers.mapping(name)
        base[name] = block.data
        regimes[name] = [_regime(block, 1, seed)]
    shifts = root.raw("shifts", None)
    if shifts is None:
        shifts = []
    if not isinstance(shifts, list):
        shown = repr(shifts) if len(repr(shifts)) <= 60 else repr(shifts)[:57] + "..."
        raise root.error("shifts", f"expected a list of {{at_round, providers}}, got {shown}")
    last = 2
    for i, item in enumerate(shifts):
        shift = Block(item, f"shifts[{i}]", source)
        at = shift.number("at_round", integer=True, minimum=2, maximum=rounds)
        if at < last:
            raise shift.error("at_round", f"expected >= {last}, the previous shift's at_round")
        last = at
        named = shift.mapping("providers")
        if not named.data:
            raise shift.error("providers", "expected at least one provider block")
        for name in named.data:
            if name not in base:
                close = difflib.get_close_matches(str(name), list(base), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise named.error(str(name), f"not a provider of this spec{hint}")
            if regimes[name][-1].from_round == at:
                raise named.error(str(name), f"shifted twice at round {at}")
            over = named.mapping(name)
            merged = Block(_merge(base[name], over.data), over.where, source)
            regimes[name].append(_regime(merged, at, seed))
        shift.finish()
    root.finish()
    shift_rounds = sorted({r.from_round for rs in regimes.values() for r in rs} - {1})
    return TraceSpec(rounds, seed, {n: tuple(rs) for n, rs in regimes.items()}, tuple(shift_rounds))


def synth_arm(provider: str, round_id: int, regime: Regime) -> dict[str, Any]:
    """One provider's arm of one round, in the rounds format ``replay`` reads."""
    fate = regime.spec.draw(f"{provider}:{round_id}")
    queue_s, run_s, outcome = fate["queue_s"], fate["run_s"], fate["outcome"]
    return {
        "state": "FAILED" if outcome == "failed" else "COMPLETED",
        "wall_s": round(queue_s + run_s, 6),
        "valid": outcome == "ok",
        "validation_reasons": ["near-silent (sim outcome invalid)"] if outcome == "invalid" else [],
        "metrics": {"queue_delay_ms": round(queue_s * 1000.0, 3)} if regime.queue_signal else {},
        "error": "simulated failure" if outcome == "failed" else None,
        "sim": {
            "slow": fate["slow"],
            "queue_s": queue_s,
            "run_s": run_s,
            "outcome": outcome,
            "regime_from": regime.from_round,
        },
    }


def synth_rounds(spec: Any, source: str = "<spec>") -> list[dict[str, Any]]:
    """The rounds a spec describes (a mapping, or a parsed :class:`TraceSpec`), one dict each."""
    parsed = spec if isinstance(spec, TraceSpec) else parse_spec(spec, source)
    records = []
    for round_id in range(1, parsed.rounds + 1):
        arms = {p: synth_arm(p, round_id, parsed.regime(p, round_id)) for p in parsed.providers}
        valid = {p: a["wall_s"] for p, a in arms.items() if a["valid"]}
        winner = min(valid, key=valid.__getitem__) if valid else None
        records.append(
            {
                "kind": "round",
                "stage": STAGE,
                "round_id": round_id,
                "block": 1,
                "winner": winner,
                "winner_wall_s": valid[winner] if winner else None,
                "providers": arms,
            }
        )
    return records


def segments(rounds: int, shift_rounds: Sequence[int]) -> list[tuple[int, int]]:
    """The inclusive round ranges between shifts: before the first, between, after the last."""
    starts = [1, *(s for s in shift_rounds if 1 < s <= rounds)]
    ends = [s - 1 for s in starts[1:]] + [rounds]
    return list(zip(starts, ends, strict=True))


def summary(records: Sequence[Mapping[str, Any]], shift_rounds: Sequence[int]) -> str:
    """One line: per segment between shifts, each provider's valid count and valid p50/p95."""
    parts = []
    for first, last in segments(len(records), shift_rounds):
        chunk = [r for r in records if first <= int(r["round_id"]) <= last]
        cells = []
        for provider in chunk[0]["providers"] if chunk else ():
            arms = [r["providers"][provider] for r in chunk]
            walls = [float(a["wall_s"]) for a in arms if a["valid"]]
            stats = (
                f" p50 {nearest_rank(walls, 0.5):.1f} s p95 {nearest_rank(walls, 0.95):.1f} s"
                if walls
                else ""
            )
            cells.append(f"{provider} {len(walls)}/{len(arms)} valid{stats}")
        parts.append(f"rounds {first}-{last}: " + ", ".join(cells))
    return f"{len(records)} rounds; " + "; ".join(parts)
