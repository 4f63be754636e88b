"""The lease store's Lua scripts: loaded once at import, registered once per client.

Each ``lua/*.lua`` file starts with a comment block listing its KEYS, ARGV and return codes.
:func:`raise_for_code` is the one place where those integer codes become typed exceptions.
"""

from __future__ import annotations

import weakref
from importlib import resources
from typing import Any

from ..errors import LeaseLost, StaleToken

# Return codes shared by the scripts (see each script's header).
OK = 1
BUSY = 0
GONE = -1  # no lease: it expired or was freed
NOT_HOLDER = -2  # the lease carries another token
STALE = -3  # a newer token was already accepted
UNKNOWN_GPU = -4

SCRIPT_NAMES = (
    "claim",
    "renew",
    "release",
    "check_fence",
    "force_release",
    "restore",
    "wait_claim",
    "leave",
)

_SOURCES = {
    name: resources.files(__package__).joinpath("lua", f"{name}.lua").read_text("utf-8")
    for name in SCRIPT_NAMES
}

_registered: weakref.WeakKeyDictionary[Any, LuaScripts] = weakref.WeakKeyDictionary()


class LuaScripts:
    """The scripts registered on one client (redis-py sends EVALSHA, loading on NOSCRIPT)."""

    def __init__(self, client: Any):
        for name, source in _SOURCES.items():
            setattr(self, name, client.register_script(source))

    claim: Any
    renew: Any
    release: Any
    check_fence: Any
    force_release: Any
    restore: Any
    wait_claim: Any
    leave: Any


def scripts_for(client: Any) -> LuaScripts:
    """The :class:`LuaScripts` of ``client``, registered on first use and then reused."""
    found = _registered.get(client)
    if found is None:
        found = LuaScripts(client)
        _registered[client] = found
    return found


def raise_for_code(code: int, gpu_id: str, token: int, current: int = 0) -> None:
    """Raise the typed error a script's return code means; return quietly on success codes."""
    if code == GONE:
        raise LeaseLost(gpu_id, token, f"lease on GPU {gpu_id!r} with token {token} has expired")
    if code == NOT_HOLDER:
        detail = f" (token {current} holds it now)" if current else ""
        raise LeaseLost(
            gpu_id, token, f"GPU {gpu_id!r} is held by another lease than token {token}{detail}"
        )
    if code == STALE:
        raise StaleToken(gpu_id, token, current)
    if code not in (OK, BUSY):
        raise RuntimeError(f"unexpected lease script code {code} for GPU {gpu_id!r}")
