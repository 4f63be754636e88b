"""Adapter types by name, and parsing and building providers from their config entries.

``adapter: sim``, ``http``, ``pool`` and ``runpod`` are built in. Another adapter type (a
vendor SDK) plugs in with one call, by class or by ``"module:Class"`` path so its heavy imports
load only when a config uses it::

    register_adapter("modal", "mypkg.modal_provider:ModalProvider")

A config may also name a class directly: ``adapter: "mypkg.modal_provider:ModalProvider"``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from typing import Any

from .. import plugins
from ..errors import ConfigError, PluginNotImported
from .base import Provider
from .options import Block
from .provider_config import ROLES, ProviderConfig

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+\Z")
_ADAPTERS: dict[str, type[Provider] | str] = {
    "sim": "gpuhedge_celery.providers.sim:SimProvider",
    "http": "gpuhedge_celery.providers.http:HttpProvider",
    "pool": "gpuhedge_celery.providers.pool:PoolProvider",
    "modal": "gpuhedge_celery.providers.modal:ModalProvider",  # imports the SDK only when used
    "runpod": "gpuhedge_celery.providers.runpod:RunpodProvider",
    "cerebrium": "gpuhedge_celery.providers.cerebrium:CerebriumProvider",
}


def register_adapter(name: str, cls: type[Provider] | str | None = None) -> Any:
    """Register adapter type ``name`` (a Provider subclass or ``"module:Class"``).

    Usable as a decorator: ``@register_adapter("modal")`` above the class.
    """

    def register(target: type[Provider] | str) -> type[Provider] | str:
        _ADAPTERS[name] = target
        return target

    return register(cls) if cls is not None else register


def known_adapters() -> list[str]:
    """Registered adapter type names, sorted."""
    return sorted(_ADAPTERS)


def _import(path: str, key: str | None, file: str | None) -> type[Provider] | None:
    """The class a ``module:Class`` path names; None under ``config check`` for a module that
    is not the package's own (plugin code is not run there: :mod:`..plugins`)."""
    module_name, _, attr = path.partition(":")
    if plugins.dry() and not module_name.startswith("gpuhedge_celery."):
        return None
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import adapter {path!r}: {e}", file=file, key=key) from e
    if not (isinstance(target, type) and issubclass(target, Provider)):
        raise ConfigError(f"{path!r} is not a Provider subclass", file=file, key=key)
    return target


def adapter_class(
    name: str, *, key: str | None = None, file: str | None = None
) -> type[Provider] | None:
    """The Provider class for adapter ``name`` (a registered name or ``"module:Class"``; None
    for a plugin's class under ``config check``)."""
    target = _ADAPTERS.get(name)
    if target is None:
        if ":" in name:
            return _import(name, key, file)
        known = ", ".join(known_adapters())
        raise ConfigError(
            f"unknown adapter {name!r} (expected one of {known}, or 'module:Class')",
            file=file,
            key=key,
        )
    if isinstance(target, str):
        found = _import(target, key, file)
        if found is None:
            return None
        _ADAPTERS[name] = target = found
    return target


def parse_provider(
    name: str, data: Mapping[str, Any], *, source: str | None = None, time_scale: float = 1.0
) -> ProviderConfig:
    """Validate one ``providers.<name>`` mapping on its own (as ``build_provider`` accepts)."""
    holder = Block({name: data}, "providers", source)
    holder.raw(name)
    return parse_provider_entry(holder, name, time_scale)


def parse_provider_entry(parent: Block, name: str, time_scale: float) -> ProviderConfig:
    """Validate entry ``name`` of the ``providers:`` block ``parent``, the adapter's own block
    included (the adapter class parses it)."""
    if not _NAME_RE.match(name):
        raise parent.error(name, "expected a provider name of letters, digits, '_', '-' or '.'")
    block = parent.mapping(name)
    adapter = block.string("adapter")
    cls = adapter_class(adapter, key=block.key("adapter"), file=block.file)
    # the adapter's own block sits under its type name (or `options` for a module:Class)
    block_key = adapter if block.has(adapter) or ":" not in adapter else "options"
    adapter_block = block.mapping(block_key)
    # a plugin's adapter under config check: its own block is not checked (no plugin code runs)
    spec = cls.parse_options(adapter_block, time_scale=time_scale) if cls is not None else None
    timeout_s = block.number("timeout_s", None, positive=True)
    config = ProviderConfig(
        name=name,
        adapter=adapter,
        role=block.string("role", "primary", choices=ROLES),
        gpu=block.string("gpu", None),
        billed_rate_per_s=block.number("billed_rate_per_s", 0.0, minimum=0.0),
        idle_billed_seconds=block.number("idle_billed_seconds", 0.0, minimum=0.0),
        deployed=block.boolean("deployed", True),
        timeout_s=timeout_s,
        options=dict(adapter_block.data),
        spec=spec,
        time_scale=time_scale,
        source=block.file,
    )
    block.finish()
    return config


def build_provider(name: str, cfg: ProviderConfig | Mapping[str, Any], **kwargs: Any) -> Provider:
    """Build provider ``name`` from its config entry (a parsed ``ProviderConfig`` or the raw
    mapping under ``providers.<name>``). Keyword arguments go to the adapter: ``clock``,
    ``sleep``, ``env`` (for ``${VAR}``, default ``os.environ``), ``ledger`` (sim)..."""
    if not isinstance(cfg, ProviderConfig):
        cfg = parse_provider(name, cfg)
    elif cfg.name != name:
        cfg = cfg.renamed(name)
    cls = adapter_class(cfg.adapter, key=f"providers.{name}.adapter", file=cfg.source)
    if cls is None:
        raise PluginNotImported(
            f"adapter {cfg.adapter!r} is a plugin's, not imported here",
            file=cfg.source,
            key=f"providers.{name}.adapter",
        )
    return cls.from_config(cfg, **kwargs)
