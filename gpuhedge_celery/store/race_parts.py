"""A race's state saved in parts, so that a step sends Redis only the parts it changed.

A race's state (about 1.5-4 KB of JSON) used to be written whole by every save, ten-odd times
per race. Most of it does not change from one step to the next: the spec, the caller, the
attempts the step did not touch, the results already in. So the state hash keeps it in parts,
one field each:

* ``p:r``: the state without the race's attempts and without its results, and under
  ``~parts`` their shape (the number of attempts, the result keys), so a reader knows what to
  put back;
* ``p:a:<i>``: the race's ``i``-th attempt (``state["race"]["attempts"][i]``);
* ``p:x:<key>``: one entry of ``state["results"]``.

A state without those members (any other dict) is one part, ``p:r``. Splitting costs one JSON
encoding per part instead of one for the whole, about the same CPU for a race's few parts.

A save names the parts that differ from the state it was computed from (its base: the version
the save expects, as this process last saved or read it) and the parts that are gone; the save
script applies them only if the race is still at that version *and* that version was written
by the save the base came from (its id heads the race's history of saves), so a delta is never
applied to a different state. Without a base a save writes every part and drops the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import codec
from .codec import dumps_dict

PREFIX = "p:"
REST = "p:r"
ATTEMPT = "p:a:"
RESULT = "p:x:"
SHAPE = "~parts"  # in the rest: which members were saved apart, and their size
LEGACY = "data"  # the whole state in one field, as states were saved before parts


@dataclass(frozen=True)
class EncodedState:
    """A state as the fields of its parts (field -> JSON text)."""

    parts: dict[str, str]

    @property
    def size(self) -> int:
        """Bytes of JSON in all the parts (what a full write sends)."""
        return sum(len(v) for v in self.parts.values())


def encode(state: dict[str, Any], what: str) -> EncodedState:
    """``state`` as parts; ValueError naming ``what`` when it is not a JSON dict."""
    if not isinstance(state, dict):
        raise ValueError(f"{what} must be a dict, got {type(state).__name__}")
    race = state.get("race")
    attempts = race.get("attempts") if isinstance(race, dict) else None
    results = state.get("results")
    parts: dict[str, str] = {}
    shape: dict[str, Any] = {}
    rest = dict(state)
    try:
        if isinstance(attempts, list):
            rest["race"] = {k: v for k, v in race.items() if k != "attempts"}
            shape["attempts"] = len(attempts)
            for i, attempt in enumerate(attempts):
                parts[f"{ATTEMPT}{i}"] = codec.dumps(attempt)
        if isinstance(results, dict):
            del rest["results"]
            shape["results"] = list(results)
            for key, value in results.items():
                parts[f"{RESULT}{key}"] = codec.dumps(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not JSON-serialisable: {e}") from None
    if shape:
        rest[SHAPE] = shape
    parts[REST] = dumps_dict(rest, what)
    return EncodedState(parts)


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def parts_of(fields: dict[Any, Any]) -> dict[str, str] | None:
    """The parts among a state hash's fields (``HGETALL``); None when it holds no state."""
    parts = {}
    for name, value in fields.items():
        name = _text(name)
        if name.startswith(PREFIX):
            parts[name] = _text(value)
    return parts or None


def decode(parts: dict[str, str]) -> dict[str, Any]:
    """The state the parts hold (a fresh dict each call: callers change what they get)."""
    state = codec.loads(parts[REST])
    shape = state.pop(SHAPE, None)
    if shape is not None:
        if "attempts" in shape:
            n = shape["attempts"]
            state["race"]["attempts"] = [codec.loads(parts[f"{ATTEMPT}{i}"]) for i in range(n)]
        if "results" in shape:
            state["results"] = {k: codec.loads(parts[f"{RESULT}{k}"]) for k in shape["results"]}
    return state


def decode_fields(fields: dict[Any, Any]) -> dict[str, Any] | None:
    """The state in a state hash's fields, whether saved in parts or whole (an older save)."""
    parts = parts_of(fields)
    if parts is not None:
        return decode(parts)
    legacy = fields.get(LEGACY, fields.get(LEGACY.encode()))
    return None if legacy is None else codec.loads(legacy)


def delta(base: dict[str, str], new: dict[str, str]) -> tuple[list[str], list[str]]:
    """What turns ``base`` into ``new``: the parts to set (field, JSON, field, JSON, ...) and
    the fields to delete."""
    changed: list[str] = []
    for name, value in new.items():
        if base.get(name) != value:
            changed += (name, value)
    return changed, [name for name in base if name not in new]
