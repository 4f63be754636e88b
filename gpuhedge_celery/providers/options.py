"""Typed reading of YAML mappings with one-line errors that name the file, key and expectation.

Used by :mod:`gpuhedge_celery.config` and by every adapter for its own block, so a typo anywhere
reads the same way::

    config/gpuhedge.yaml: providers.runpod.billed_rate_per_s: expected a number >= 0, got 'x'

Every key a reader takes is remembered; :meth:`Block.finish` reports the keys nobody took
(unknown keys are errors, never silently ignored), with a close match when there is one.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ConfigError

_MISSING: Any = object()


class Block:
    """A mapping read from config, remembering where it lives (file and dotted key)."""

    def __init__(self, data: Any, where: str = "", file: str | None = None):
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"expected a mapping, got {_show(data)}", file=file, key=where or None
            )
        self.data = data
        self.where = where
        self.file = file
        self._taken: set[str] = set()

    def key(self, name: str) -> str:
        """The dotted path of ``name`` inside this block."""
        return f"{self.where}.{name}" if self.where else str(name)

    def error(self, name: str | None, message: str) -> ConfigError:
        """A :class:`ConfigError` located at ``name`` inside this block (or the block itself)."""
        return ConfigError(message, file=self.file, key=self.key(name) if name else self.where)

    def has(self, name: str) -> bool:
        return name in self.data

    def raw(self, name: str, default: Any = _MISSING) -> Any:
        """The value at ``name`` as YAML gave it; an error when absent and no default."""
        self._taken.add(name)
        if name in self.data:
            return self.data[name]
        if default is _MISSING:
            raise self.error(name, "required key is missing")
        return default

    def number(
        self,
        name: str,
        default: Any = _MISSING,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        positive: bool = False,
        integer: bool = False,
    ) -> Any:
        """A number (bools refused), optionally bounded; ``default`` may be None."""
        value = self.raw(name, default)
        if value is None and default is None:
            return None
        kind = "an integer" if integer else "a number"
        bounds = []
        if positive:
            bounds.append("> 0")
        if minimum is not None:
            bounds.append(f">= {minimum:g}")
        if maximum is not None:
            bounds.append(f"<= {maximum:g}")
        expected = f"{kind} {' and '.join(bounds)}".strip()
        ok_type = int if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_type):
            raise self.error(name, f"expected {expected}, got {_show(value)}")
        if value != value or (positive and value <= 0):  # NaN or non-positive
            raise self.error(name, f"expected {expected}, got {_show(value)}")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise self.error(name, f"expected {expected}, got {_show(value)}")
        return value if integer else float(value)

    def string(
        self, name: str, default: Any = _MISSING, *, choices: Iterable[str] | None = None
    ) -> Any:
        """A non-empty string, optionally one of ``choices``; ``default`` may be None."""
        value = self.raw(name, default)
        if value is None and default is None:
            return None
        options = list(choices) if choices is not None else None
        if not isinstance(value, str) or not value:
            want = f"one of {', '.join(options)}" if options else "a non-empty string"
            raise self.error(name, f"expected {want}, got {_show(value)}")
        if options is not None and value not in options:
            hint = _suggest(value, options)
            raise self.error(name, f"expected one of {', '.join(options)}, got {value!r}{hint}")
        return value

    def boolean(self, name: str, default: Any = _MISSING) -> Any:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise self.error(name, f"expected true or false, got {_show(value)}")
        return value

    def mapping(self, name: str, default: Any = _MISSING) -> Block:
        """The nested mapping at ``name`` as a :class:`Block` (an empty one when absent)."""
        value = self.raw(name, {} if default is _MISSING else default)
        if value is not None and not isinstance(value, Mapping):
            raise self.error(name, f"expected a mapping, got {_show(value)}")
        return Block(value, self.key(name), self.file)

    def string_map(self, name: str) -> dict[str, str]:
        """A mapping of strings to scalars (headers, state maps), values turned into strings."""
        block = self.mapping(name)
        out: dict[str, str] = {}
        for k, v in block.data.items():
            if not isinstance(k, str) or isinstance(v, (Mapping, list)) or v is None:
                raise block.error(str(k), f"expected a string value, got {_show(v)}")
            out[k] = str(v)
        return out

    def finish(self, extra_known: Iterable[str] = ()) -> None:
        """Raise for the first key of this block that no reader took (unknown keys are errors)."""
        known = self._taken | set(extra_known)
        for name in self.data:
            if name not in known:
                hint = _suggest(str(name), sorted(known))
                expected = f" (expected one of: {', '.join(sorted(known))})" if known else ""
                raise self.error(str(name), f"unknown key{hint or expected}")


def _suggest(value: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(value, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
