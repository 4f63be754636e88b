"""Reading one ``GPUHEDGE_*`` number or switch from the environment, with a one-line error
naming it.

Shared by the settings classes (race/settings.py, webhooks/settings.py, tasks/janitor.py):
each says what it expects, so a bad value's :class:`ConfigError` reads ``expected <what>,
got '<value>'`` with the variable as its key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from .errors import ConfigError

N = TypeVar("N", int, float)
D = TypeVar("D")


def env_number(
    env: Mapping[str, str],
    name: str,
    default: D,
    *,
    cast: Callable[[str], N],
    kind: str,
    valid: Callable[[N], bool],
    bound: str,
) -> N | D:
    """``name``'s value (stripped) as ``cast`` makes it, or ``default`` when unset or blank.

    A value ``cast`` rejects fails with ``expected <kind>``, one that is not ``valid`` with
    ``expected <bound>``.
    """
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = cast(raw)
    except ValueError:
        raise ConfigError(f"expected {kind}, got {raw!r}", key=name) from None
    if not valid(value):
        raise ConfigError(f"expected {bound}, got {raw!r}", key=name)
    return value


def env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """``name``'s on/off value (1/0, true/false, yes/no, on/off), or ``default`` when unset or
    blank; anything else is a one-line ConfigError naming the variable."""
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"expected 1/0, true/false, yes/no or on/off, got {raw!r}", key=name)
