"""A race's state saved in parts, so that a step sends Redis only the parts it changed.

A race's state is saved by every step, and most of it does not change from one step to the
next: the spec, the caller, the attempts the step did not touch, the results already in. So the
state hash keeps it in parts, one field each:

* ``p:t:<key>``: each top-level member of the state, whole (the spec, the caller, the timer
  ids...);
* ``p:s:race``: the race without its attempts, their number under ``~attempts``; ``p:s:results``:
  the results' keys (their entries are saved apart);
* ``p:a:<i>``: the race's ``i``-th attempt (``state["race"]["attempts"][i]``);
* ``p:x:<key>``: one entry of ``state["results"]``.

Splitting costs one JSON encoding per part instead of one for the whole: a little CPU per save
and read, for fewer bytes on every save (docs/benchmarks.md). A member that would not read back
as it was (a race carrying ``~attempts`` itself, results with keys other than strings) is kept
whole.

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
from .timers import as_text

PREFIX = "p:"
TOP = "p:t:"  # + a top-level key of the state: its value, whole
SPLIT = "p:s:"  # + "race" or "results": a member whose entries were saved apart (its shape)
ATTEMPT = "p:a:"  # + i: the race's i-th attempt
RESULT = "p:x:"  # + key: one entry of the state's results
ATTEMPTS = "~attempts"  # in the race's split part: how many attempts were saved apart
LEGACY = "data"  # the whole state in one field, as states were saved before parts


@dataclass(frozen=True)
class EncodedState:
    """A state as the fields of its parts (field -> JSON text)."""

    parts: dict[str, str]


def encode(state: dict[str, Any], what: str) -> EncodedState:
    """``state`` as parts; ValueError naming ``what`` when it is not a JSON dict."""
    if not isinstance(state, dict):
        raise ValueError(f"{what} must be a dict, got {type(state).__name__}")
    parts: dict[str, str] = {}
    try:
        for key, value in state.items():
            if key == "race" and _has_attempts(value):
                attempts = value["attempts"]
                for i, attempt in enumerate(attempts):
                    parts[f"{ATTEMPT}{i}"] = codec.dumps(attempt)
                rest = {k: v for k, v in value.items() if k != "attempts"}
                rest[ATTEMPTS] = len(attempts)
                parts[f"{SPLIT}race"] = codec.dumps(rest)
            elif key == "results" and _named(value):
                for name, entry in value.items():
                    parts[f"{RESULT}{name}"] = codec.dumps(entry)
                parts[f"{SPLIT}results"] = codec.dumps(list(value))
            else:
                parts[f"{TOP}{key}"] = codec.dumps(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not JSON-serialisable: {e}") from None
    return EncodedState(parts)


def _has_attempts(race: Any) -> bool:
    """Whether a race's attempts can be saved one part each: a list, and no key of the race
    that its split part would take (such a race stays whole)."""
    return (
        isinstance(race, dict) and isinstance(race.get("attempts"), list) and ATTEMPTS not in race
    )


def _named(results: Any) -> bool:
    """Whether results can be saved one part each: a dict with string keys (attempt ids);
    other keys would not read back as they were, so such results stay whole."""
    return isinstance(results, dict) and all(isinstance(k, str) for k in results)


def parts_of(fields: dict[Any, Any]) -> dict[str, str] | None:
    """The parts among a state hash's fields (``HGETALL``); None when it holds no state."""
    parts = {}
    for name, value in fields.items():
        name = as_text(name)
        if name.startswith(PREFIX):
            parts[name] = as_text(value)
    return parts or None


def decode(parts: dict[str, str]) -> dict[str, Any]:
    """The state the parts hold (a fresh dict each call: callers change what they get)."""
    state: dict[str, Any] = {}
    for name, text in parts.items():
        if name.startswith(TOP):
            state[name[len(TOP) :]] = codec.loads(text)
        elif name == f"{SPLIT}race":
            race = codec.loads(text)
            n = race.pop(ATTEMPTS)
            race["attempts"] = [codec.loads(parts[f"{ATTEMPT}{i}"]) for i in range(n)]
            state["race"] = race
        elif name == f"{SPLIT}results":
            state["results"] = {k: codec.loads(parts[f"{RESULT}{k}"]) for k in codec.loads(text)}
    return state


def field(fields: dict[Any, Any], name: str) -> Any:
    """One field of a hash read with ``HGETALL``, whether the client decodes replies or not."""
    found = fields.get(name)
    return fields.get(name.encode()) if found is None else found


def whole(fields: dict[Any, Any]) -> Any:
    """The whole state an older version saved in a state hash (``data``), else None."""
    return field(fields, LEGACY)


def decode_fields(fields: dict[Any, Any], parts: dict[str, str] | None = None) -> dict[str, Any]:
    """The state in the fields of a race's state hash (``HGETALL``; ``parts``: their
    :func:`parts_of`, when the caller has them). A whole state saved by an older version comes
    first: it is newer than any parts beside it (that version's script writes ``data`` and
    leaves the parts; this version's full write drops ``data``)."""
    legacy = whole(fields)
    if legacy is not None:
        state: dict[str, Any] = codec.loads(legacy)
        return state
    parts = parts_of(fields) if parts is None else parts
    return decode(parts) if parts else {}  # {}: an empty state has no parts


def delta(base: dict[str, str], new: dict[str, str]) -> tuple[list[str], list[str]]:
    """What turns ``base`` into ``new``: the parts to set (field, JSON, field, JSON, ...) and
    the fields to delete."""
    changed: list[str] = []
    for name, value in new.items():
        if base.get(name) != value:
            changed += (name, value)
    return changed, [name for name in base if name not in new]
