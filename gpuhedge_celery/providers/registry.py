"""Adapter types by name, and building providers from their config.

``adapter: sim`` and ``adapter: http`` are built in. Another adapter type (the GPU pool, a
vendor SDK) plugs in with one call, by class or by ``"module:Class"`` path so its heavy imports
load only when a config uses it::

    register_adapter("modal", "mypkg.modal_provider:ModalProvider")

A config may also name a class directly: ``adapter: "mypkg.modal_provider:ModalProvider"``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .base import Provider

if TYPE_CHECKING:
    from ..config import ProviderConfig

_ADAPTERS: dict[str, type[Provider] | str] = {
    "sim": "gpuhedge_celery.providers.sim:SimProvider",
    "http": "gpuhedge_celery.providers.http:HttpProvider",
    "pool": "gpuhedge_celery.providers.pool:PoolProvider",
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


def _import(path: str, key: str | None, file: str | None) -> type[Provider]:
    module_name, _, attr = path.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import adapter {path!r}: {e}", file=file, key=key) from e
    if not (isinstance(target, type) and issubclass(target, Provider)):
        raise ConfigError(f"{path!r} is not a Provider subclass", file=file, key=key)
    return target


def adapter_class(name: str, *, key: str | None = None, file: str | None = None) -> type[Provider]:
    """The Provider class for adapter ``name`` (a registered name or ``"module:Class"``)."""
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
        target = _import(target, key, file)
        _ADAPTERS[name] = target
    return target


def build_provider(name: str, cfg: ProviderConfig | Mapping[str, Any], **kwargs: Any) -> Provider:
    """Build provider ``name`` from its config entry (a parsed ``ProviderConfig`` or the raw
    mapping under ``providers.<name>``). Keyword arguments go to the adapter: ``clock``,
    ``sleep``, ``env`` (for ``${VAR}``, default ``os.environ``), ``ledger`` (sim)..."""
    from ..config import ProviderConfig, parse_provider

    if not isinstance(cfg, ProviderConfig):
        cfg = parse_provider(name, cfg)
    elif cfg.name != name:
        cfg = cfg.renamed(name)
    cls = adapter_class(cfg.adapter, key=f"providers.{name}.adapter", file=cfg.source)
    return cls.from_config(cfg, **kwargs)
