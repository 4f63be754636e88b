"""Configuration of the ``modal`` adapter (the ``providers.<name>.modal`` block).

YAML (every key; see docs/providers.md#modal)::

    modal:
      app: tts                      # required: the deployed Modal app
      function: synthesize          # the function to spawn, or instead:
      # cls: Synth                  #   a class of the app ...
      # method: synthesize          #   ... and its method: Cls.from_name(app, cls)().method
      environment: main             # optional: the Modal environment (else the SDK's default)
      payload: audio_base64         # optional: dotted path into the return value (default: all)
      timeouts: {spawn_s: 20, poll_s: 2, cancel_s: 10}   # bound on each blocking SDK call
      poll_interval_s: 0.5          # result()'s polling
      cancel_confirm_s: 10          # how long a cancel looks for the input's end
      max_poll_errors: 3            # failed polls in a row before result() reports FAILED
      sdk_threads: 8                # threads running SDK calls, per process
      # tests and simulations only: another ModalClient (a "module:Class") and its options
      # sdk: "tests.support.modal_fake_sdk:FakeModalClient"
      # sdk_options: {url: "${MODAL_FAKE_URL}"}

``app``, ``function``, ``cls``, ``method``, ``environment`` and string ``sdk_options`` may use
``${ENV}``, resolved when the provider is built. Nothing here is scaled by ``time_scale``:
the SDK calls and the Modal jobs run in real time.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .httpspec import substitute_env
from .modal_sdk import INSTALL_HINT, ModalClient, ModalTarget, SdkModalClient, modal_available
from .options import Block


@dataclass(frozen=True)
class ModalSpec:
    """The parsed block; ``target`` and ``sdk_options`` keep their ``${ENV}`` unresolved."""

    target: ModalTarget
    payload: str | None = None
    spawn_timeout_s: float = 20.0
    poll_timeout_s: float = 2.0
    cancel_timeout_s: float = 10.0
    poll_interval_s: float = 0.5
    cancel_confirm_s: float = 10.0
    max_poll_errors: int = 3
    sdk_threads: int = 8
    sdk: str | None = None
    sdk_options: Mapping[str, Any] = field(default_factory=dict)
    file: str | None = None
    where: str = ""

    @classmethod
    def from_block(cls, block: Block) -> ModalSpec:
        sdk = block.string("sdk", None)
        if sdk is not None and ":" not in sdk:
            raise block.error("sdk", f"expected 'module:Class', got {sdk!r}")
        if sdk is None and not modal_available():
            raise block.error(None, INSTALL_HINT)
        app = block.string("app")
        function = block.string("function", None)
        cls_name = block.string("cls", None)
        method = block.string("method", None)
        if cls_name is not None and function is not None:
            raise block.error("cls", "give either function, or cls and method, not both")
        if cls_name is not None and method is None:
            raise block.error("method", "required with cls (Cls.from_name(app, cls)().method)")
        if cls_name is None and method is not None:
            raise block.error("method", "only valid with cls")
        if cls_name is None and function is None:
            raise block.error("function", "required key is missing (or give cls and method)")
        target = ModalTarget(app, function, cls_name, method, block.string("environment", None))
        timeouts = block.mapping("timeouts")
        spawn_s = timeouts.number("spawn_s", 20.0, positive=True)
        poll_s = timeouts.number("poll_s", 2.0, positive=True)
        cancel_s = timeouts.number("cancel_s", 10.0, positive=True)
        timeouts.finish()
        options = block.mapping("sdk_options")
        if options.data and sdk is None:
            raise block.error("sdk_options", "only valid with sdk")
        spec = cls(
            target=target,
            payload=block.string("payload", None),
            spawn_timeout_s=spawn_s,
            poll_timeout_s=poll_s,
            cancel_timeout_s=cancel_s,
            poll_interval_s=block.number("poll_interval_s", 0.5, positive=True),
            cancel_confirm_s=block.number("cancel_confirm_s", 10.0, minimum=0.0),
            max_poll_errors=block.number("max_poll_errors", 3, integer=True, minimum=1),
            sdk_threads=block.number("sdk_threads", 8, integer=True, minimum=1, maximum=256),
            sdk=sdk,
            sdk_options=dict(options.data),
            file=block.file,
            where=block.where,
        )
        block.finish()
        return spec

    def resolved_target(self, env: Mapping[str, str]) -> ModalTarget:
        """The target with ``${ENV}`` filled in (one-line ConfigError for an unset variable)."""

        def fill(key: str, value: str | None) -> str | None:
            if value is None:
                return None
            return substitute_env(value, env, file=self.file, key=f"{self.where}.{key}")

        t = self.target
        return ModalTarget(
            app=str(fill("app", t.app)),
            function=fill("function", t.function),
            cls=fill("cls", t.cls),
            method=fill("method", t.method),
            environment=fill("environment", t.environment),
        )

    def make_client(self, env: Mapping[str, str]) -> ModalClient:
        """The SDK client: the real one, or the ``sdk`` class (tests, simulations) built from
        ``sdk_options`` with their string values' ``${ENV}`` filled in."""
        if self.sdk is None:
            return SdkModalClient()
        key = f"{self.where}.sdk"
        module_name, _, attr = self.sdk.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"cannot import {self.sdk!r}: {e}", file=self.file, key=key) from e
        options = {
            k: substitute_env(v, env, file=self.file, key=f"{self.where}.sdk_options.{k}")
            if isinstance(v, str)
            else v
            for k, v in self.sdk_options.items()
        }
        client = factory(options)
        for method in ("spawn", "poll", "cancel"):
            if not callable(getattr(client, method, None)):
                raise ConfigError(f"{self.sdk!r} has no {method}()", file=self.file, key=key)
        return client
