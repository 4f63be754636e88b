"""Copying plain data for ``to_dict`` methods, without :func:`dataclasses.asdict`'s overhead.

``asdict`` deep-copies every field through a generic recursive walk (and ``copy.deepcopy`` for
anything that is not a container), which made state (de)serialisation a visible share of a race
worker's CPU. The core's ``to_dict`` methods list their fields explicitly instead and use
:func:`copy_data` only for fields that may hold nested containers, so their output is equal to
what ``asdict`` gave and still shares no mutable container with the object.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any, TypeVar

E = TypeVar("E", bound=enum.Enum)

_SCALARS = (str, int, float, bool, type(None))


def copy_data(value: Any) -> Any:
    """A deep copy of ``value`` equal to the one ``dataclasses.asdict`` makes of a field.

    Lists, tuples and dicts are rebuilt recursively (keeping their types); scalars are returned as
    they are (immutable, so ``deepcopy`` would return them unchanged too); a dataclass instance
    becomes its ``asdict`` and anything else is ``copy.deepcopy``'d, exactly as ``asdict`` does.
    """
    cls = type(value)
    if cls in _SCALARS:
        return value
    if cls is dict:
        return {copy_data(k): copy_data(v) for k, v in value.items()}
    if cls is list:
        return [copy_data(v) for v in value]
    if cls is tuple:
        return tuple(copy_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple, as asdict does
        return cls(*[copy_data(v) for v in value])
    if isinstance(value, (list, tuple)):
        return cls(copy_data(v) for v in value)
    if isinstance(value, dict):
        return cls((copy_data(k), copy_data(v)) for k, v in value.items())
    return copy.deepcopy(value)


def enum_by_value(cls: type[E]) -> dict[Any, E]:
    """A value -> member table for :func:`to_enum`."""
    return {member.value: member for member in cls}


def to_enum(cls: type[E], table: dict[Any, E], value: Any) -> E:
    """``cls(value)`` with a dict lookup first: Enum's own call is slow on a hot path.

    Anything the table does not hold (a bad or unhashable value, say) goes to
    ``cls(value)``, so results and errors are exactly those of ``cls(value)``.
    """
    try:
        return table[value]
    except (KeyError, TypeError):
        return cls(value)
