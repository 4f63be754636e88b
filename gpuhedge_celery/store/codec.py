"""JSON for what the race store writes and reads on every step (states, jobs, timers, results).

orjson, not the standard library: a race's state is encoded on every save and decoded on every
read, and orjson does both several times faster with the same compact text (docs/benchmarks.md).
Non-string keys become strings, as ``json`` makes them.
"""

from __future__ import annotations

from typing import Any

import orjson

_OPTIONS = orjson.OPT_NON_STR_KEYS


def dumps(value: Any) -> str:
    """Compact JSON text; ``TypeError`` (orjson's ``JSONEncodeError``) for what JSON cannot hold."""
    return orjson.dumps(value, option=_OPTIONS).decode("utf-8")


def size(value: Any) -> int:
    """Bytes of ``value`` as compact UTF-8 JSON."""
    return len(orjson.dumps(value, option=_OPTIONS))


def loads(data: str | bytes) -> Any:
    """Parse JSON text (``ValueError`` when it is not JSON)."""
    return orjson.loads(data)


def dumps_dict(value: dict[str, Any], what: str) -> str:
    """``value`` (a dict) as JSON; ValueError naming ``what`` when it is not one or not JSON."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a dict, got {type(value).__name__}")
    try:
        return dumps(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not JSON-serialisable: {e}") from None


def ms(seconds: float | None) -> int:
    """Seconds as whole milliseconds for a Redis expiry (at least 1); None is 0 (none)."""
    return 0 if seconds is None else max(1, int(seconds * 1000))
