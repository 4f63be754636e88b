"""Every Lua script of the package, registered once per client, and the lease return codes.

Each ``lua/*.lua`` file starts with a comment block listing its KEYS, ARGV and return codes;
``lua/_token.lua`` is no script but the fencing-token rule, put before each script that uses it.
:func:`lua_script` is the one registration path (lease, race and timer stores all use it);
:func:`raise_for_code` is the one place where the lease scripts' codes become typed exceptions.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterable
from functools import cache
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError

from ..errors import LeaseLost, StaleToken

# Return codes shared by the scripts (see each script's header).
OK = 1
BUSY = 0
GONE = -1  # no lease: it expired or was freed
NOT_HOLDER = -2  # the lease carries another token (or this token with another holder)
STALE = -3  # a newer token was already accepted
UNKNOWN_GPU = -4
OUT_OF_POOL = -6  # the GPU takes no new lease (drained, unhealthy, model not loaded)

SCRIPT_NAMES = (
    "claim",
    "renew",
    "release",
    "check_fence",
    "force_release",
    "restore",
    "wait_claim",
    "leave",
    "out_clear",
    "fence_lift",
)


# Scripts that name one of these get lua/_token.lua (the fencing-token rule) put before them.
_TOKEN_FUNCTIONS = re.compile(r"\b(?:next_token|token_text)\(")


def _read_lua(name: str) -> str:
    return resources.files(__package__).joinpath("lua").joinpath(f"{name}.lua").read_text("utf-8")


@cache
def _lua_source(name: str) -> str:
    source = _read_lua(name)
    if _TOKEN_FUNCTIONS.search(source):
        return _read_lua("_token") + source
    return source


_scripts: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def lua_script(client: Any, name: str) -> Any:
    """The ``lua/<name>.lua`` script registered on ``client``, registered once and reused.

    redis-py sends EVALSHA and loads the source only when the server answers NOSCRIPT, so the
    script text crosses the network once per server, not once per call.
    """
    scripts = _scripts.setdefault(client, {})
    script = scripts.get(name)
    if script is None:
        script = scripts[name] = client.register_script(_lua_source(name))
    return script


def run_pipeline(
    client: Any,
    build: Callable[[Any], None],
    scripts: Iterable[Any] = (),
    *,
    raise_on_error: bool = True,
) -> list[Any]:
    """Run the commands ``build(pipe)`` queues in one non-transactional pipeline (one round trip).

    Scripts must be queued as ``pipe.evalsha(script.sha, ...)`` (see :func:`queue_script`), not
    by calling the script on the pipeline: redis-py then sends ``SCRIPT EXISTS`` before every
    execute, a second round trip on the hottest path of a race step. When the server does not
    know a script (a restart, ``SCRIPT FLUSH``) it is loaded and the pipeline is rebuilt and run
    once more, so every command in it must be safe to repeat. ``raise_on_error=False``: an
    error of one command is its reply (an exception object) and the others' replies still come.
    """
    for attempt in (1, 2):
        pipe = client.pipeline(transaction=False)
        build(pipe)
        try:
            replies: list[Any] = pipe.execute(raise_on_error=raise_on_error)
        except NoScriptError:
            if attempt == 2:
                raise
        else:
            if attempt == 2 or not any(isinstance(r, NoScriptError) for r in replies):
                return replies
        for script in scripts:
            client.script_load(script.script)
    raise AssertionError("unreachable")


def queue_script(pipe: Any, script: Any, keys: list[Any], args: list[Any]) -> None:
    """Queue one registered script on ``pipe`` as a plain EVALSHA (for :func:`run_pipeline`)."""
    pipe.evalsha(script.sha, len(keys), *keys, *args)


_registered: weakref.WeakKeyDictionary[Any, LuaScripts] = weakref.WeakKeyDictionary()


class LuaScripts:
    """The lease scripts of one client, as attributes (each from :func:`lua_script`)."""

    def __init__(self, client: Any):
        for name in SCRIPT_NAMES:
            setattr(self, name, lua_script(client, name))

    claim: Any
    renew: Any
    release: Any
    check_fence: Any
    force_release: Any
    restore: Any
    wait_claim: Any
    leave: Any
    out_clear: Any
    fence_lift: Any


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
