"""The validator registry: the verdict type, registration by name, option checks and
:func:`validate`. Kept apart from the built-in validators so that a validator module can
register itself without importing them (``validators.py`` imports every built-in one).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError


@dataclass(frozen=True)
class ValidationResult:
    """The verdict of a validator: ``ok`` plus human-readable ``reasons`` when it is not."""

    ok: bool
    reasons: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def passed(cls, **details: Any) -> ValidationResult:
        return cls(True, (), details)

    @classmethod
    def failed(cls, *reasons: str, **details: Any) -> ValidationResult:
        return cls(False, tuple(reasons) or ("rejected",), details)

    @classmethod
    def check(cls, ok: bool, reason: str, **details: Any) -> ValidationResult:
        """``passed`` when ``ok``, else ``failed(reason)``: for one-condition validators."""
        return cls.passed(**details) if ok else cls.failed(reason, **details)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "reasons": list(self.reasons), "details": dict(self.details)}


ValidatorFn = Callable[..., Any]

_REGISTRY: dict[str, ValidatorFn] = {}


def validator(name: str) -> Callable[[ValidatorFn], ValidatorFn]:
    """Register the decorated function as the validator called ``name`` (replacing any other).

    The function receives the payload and the validator's options as keyword arguments and
    returns a :class:`ValidationResult` (a bare ``bool`` is accepted too).
    """
    if not isinstance(name, str) or not name:
        raise ValueError("a validator needs a non-empty name")

    def register(fn: ValidatorFn) -> ValidatorFn:
        _REGISTRY[name] = fn
        return fn

    return register


OptionCheck = Callable[[Mapping[str, Any]], "str | None"]
_OPTION_CHECKS: dict[str, OptionCheck] = {}


def option_check(name: str) -> Callable[[OptionCheck], OptionCheck]:
    """Register the decorated function as the option check of validator ``name``: given the
    options, it says what is wrong with them (None: nothing), when a config or call names them."""

    def register(fn: OptionCheck) -> OptionCheck:
        _OPTION_CHECKS[name] = fn
        return fn

    return register


def options_problem(name: str, options: Mapping[str, Any]) -> str | None:
    """What is wrong with ``options`` for validator ``name`` (which must be registered): an
    option its function does not take, or what its option check finds; None when usable."""
    try:
        inspect.signature(get_validator(name)).bind(None, **options)
    except TypeError as e:
        return f"bad options for validator {name!r}: {e}"
    check = _OPTION_CHECKS.get(name)
    found = check(options) if check is not None else None
    return None if found is None else f"validator {name!r}: {found}"


def available_validators() -> list[str]:
    """Names of every registered validator, sorted."""
    return sorted(_REGISTRY)


def get_validator(name: str) -> ValidatorFn:
    """The validator called ``name``; a :class:`ConfigError` listing the known ones if none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(available_validators())
        raise ConfigError(f"unknown validator {name!r} (known: {known})", key="validator") from None


def validate(name: str, payload: Any, **options: Any) -> ValidationResult:
    """Run the validator ``name`` on ``payload``; a validator that raises counts as a rejection."""
    fn = get_validator(name)
    try:
        verdict = fn(payload, **options)
    except TypeError as e:
        if "unexpected keyword" in str(e):
            # bad options are a configuration mistake, not a bad payload
            raise ConfigError(f"validator {name!r}: {e}", key="validator") from e
        return ValidationResult.failed(f"{name}: validator raised {type(e).__name__}: {e}")
    except Exception as e:  # a user validator crashing must not crash the race
        return ValidationResult.failed(f"{name}: validator raised {type(e).__name__}: {e}")
    if isinstance(verdict, ValidationResult):
        return verdict
    if isinstance(verdict, bool):
        return ValidationResult.check(verdict, f"rejected by validator {name!r}")
    raise TypeError(f"validator {name!r} returned {type(verdict).__name__}, not ValidationResult")
