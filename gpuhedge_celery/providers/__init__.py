"""GPU providers: the four-method contract, the built-in adapters and the adapter registry.

``Provider`` (base.py) is the contract; ``sim`` and ``http`` are adapters; ``build_provider``
turns a config entry into a provider. Importing this package loads neither httpx nor the sim.
"""

from __future__ import annotations

from .base import Provider
from .registry import adapter_class, build_provider, known_adapters, register_adapter

__all__ = ["Provider", "adapter_class", "build_provider", "known_adapters", "register_adapter"]
