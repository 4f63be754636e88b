"""Plugin modules: the only code that a config can have imported, and never a message.

A plugin is a module that registers policies, validators or adapters when imported. It is
imported only when a trusted source lists it: the config file (its ``plugins:`` list, and the
module of a ``policy.name`` or ``adapter`` written as ``module:Name``) or the worker's
environment (``GPUHEDGE_PLUGINS``). A name that arrives in a task message (``hedged_infer(
policy="pkg.mod:kind")``) resolves only to a module already imported that way: a message
imports nothing. ``config check`` validates a config with :func:`without_plugin_code`: the
modules it names are listed, not imported, so checking a file never runs code it names.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from .errors import ConfigError

MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")
_loaded: set[str] = set()
_dry: ContextVar[bool] = ContextVar("gpuhedge_plugins_dry", default=False)


def load(
    modules: Iterable[str], *, key: str, file: str | None = None, what: str = "plugin"
) -> None:
    """Import each module a trusted source lists (nothing under :func:`without_plugin_code`);
    a ConfigError naming ``key`` for one that is not a module path or does not import."""
    for module in modules:
        if not MODULE_RE.match(module):
            raise ConfigError(f"expected a module path, got {module!r}", file=file, key=key)
        if module in _loaded or _dry.get():
            continue
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"cannot import {what} {module!r}: {e}", file=file, key=key) from None
        _loaded.add(module)


def loaded(module: str) -> bool:
    """Whether a trusted source had ``module`` imported in this process."""
    return module in _loaded


def dry() -> bool:
    """Whether plugin code is off (``config check``): names are checked, modules not imported."""
    return _dry.get()


@contextmanager
def without_plugin_code() -> Iterator[None]:
    """Within this block no plugin module is imported (see the module's docstring)."""
    token = _dry.set(True)
    try:
        yield
    finally:
        _dry.reset(token)
