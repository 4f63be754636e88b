"""Shared by ``login-check``, ``costs`` and ``config show``: building providers for a command,
and the secrets a command must never print.

A provider's secrets are its HTTP header values and the values of keys named like secrets
(``*key*``, ``*token*``, ``*secret*``, ...) in its adapter block, written literally or as
``${VAR}`` (then the variable's value), and the SDK tokens an adapter reads from the
environment (Modal's). Every line these commands print goes through them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..config import GpuHedgeConfig
from ..providers.account import scrub
from ..providers.base import Provider

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-[^}]*)?\}")
SDK_TOKENS = ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET")
SECRET_KEY = re.compile(r"(?i)(key|token|secret|password|authorization|auth|cookie|credential)")
REDACTED = "<redacted>"


def _strings(value: Any, path: str = "") -> Iterable[tuple[str, str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _strings(v, f"{path}.{i}")


def secrets_of(cfg: GpuHedgeConfig, env: Mapping[str, str] | None = None) -> list[str]:
    """Every value a command must not print for this config (see the module docstring)."""
    env = os.environ if env is None else env
    found: set[str] = {env.get(name, "") for name in SDK_TOKENS}
    for p in cfg.providers.values():
        for path, text in _strings(dict(p.options)):
            if ".headers." in f".{path}" or SECRET_KEY.search(path.rsplit(".", 1)[-1]):
                found.add(_ENV_REF.sub("", text))  # a literal secret written in the file
                found.update(env.get(name, "") for name in _ENV_REF.findall(text))
    return sorted({s for s in found if s and len(s) >= 4}, key=len, reverse=True)


def redactor(cfg: GpuHedgeConfig) -> Callable[[str], str]:
    """A function that removes the config's secrets from one printed text."""
    secrets = secrets_of(cfg)

    def clean(text: str) -> str:
        for secret in secrets:
            text = text.replace(secret, REDACTED)
        return text

    return clean


def build_for_command(cfg: GpuHedgeConfig, name: str) -> Provider:
    """Provider ``name`` as a command uses it (a pool reads the lease table of ``--redis-url``;
    a runpod provider keeps its balance snapshots there)."""
    kwargs: dict[str, Any] = {}
    if cfg.provider(name).adapter == "pool":
        from ..cli import cli_redis_client, root_settings
        from ..store.leases import LeaseStore

        kwargs["store"] = LeaseStore(cli_redis_client(), root_settings().prefix)
    elif cfg.provider(name).adapter == "runpod":  # costs keeps its balance snapshots there
        from ..cli import cli_redis_client, root_settings
        from ..store.balances import BalanceStore

        kwargs["balances"] = BalanceStore(cli_redis_client(), root_settings().prefix)
    return cfg.build(name, **kwargs)


def one_line(text: Any, secrets: Iterable[str] = ()) -> str:
    """A value as one short line with the secrets removed."""
    return scrub(str(text), secrets)
