"""The ``hmac`` validator: a result counts only if the user's function signed it.

For deliveries no authenticated read can verify (a Cerebrium webhook, an ``http`` adapter's
answer): the function signs its payload with
:func:`~gpuhedge_celery.signing.sign_result` and a key shared with the workers, and this
validator checks the signature before any other check runs::

    validator:
      name: hmac
      key: "${RESULT_SIGNING_KEY}"     # a ${VAR} reference only, read on the worker
      then: {name: wav, sample_rate: 24000}   # optional: the check after the MAC (or a list)
      at: audio_base64                 # optional: what ``then`` is given (a dotted path)
      max_age_s: 600                   # optional: refuse a signed_at older than this
      field: signature                 # where the signature is (default)

``then`` may list several validators: each is given the same value, and all must pass. A
race's own validator (``hedged_infer``'s ``validator=``) cannot replace a configured ``hmac``:
:func:`adding_check` appends it to ``then`` instead, so a message only adds checks.

A result whose signature is missing or wrong is invalid (``signature missing`` / ``signature
does not match``), so it cannot win. The key is read from the worker's environment each time
and appears in no option, reason, receipt, event or log: the race's stored spec keeps the
``${VAR}`` reference as written. Registered when :mod:`.validators` is imported (it imports
this module).
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from ..signing import MIN_KEY_BYTES, SIGNATURE_FIELD, SIGNED_AT_FIELD, signature_problem
from .validator_registry import (
    ValidationResult,
    available_validators,
    option_check,
    options_problem,
    validate,
    validator,
)

ENV_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}\Z")
SIGNED = "hmac"  # the validator a race's own validator may add to, never replace


def _listed(then: Any) -> list[Any]:
    """``then`` as a list of validators (one, a list of them, or none)."""
    if then is None:
        return []
    return list(then) if isinstance(then, (list, tuple)) else [then]


def _then(then: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(then, str):
        return then, {}
    return then["name"], {k: v for k, v in then.items() if k != "name"}


def adding_check(options: Mapping[str, Any], check: Mapping[str, Any]) -> dict[str, Any]:
    """``hmac`` ``options`` that also run ``check`` (``{"name": ..., **options}``) after the
    signature and their own ``then``, on the value ``then`` is given."""
    return {**options, "then": [*_listed(options.get("then")), dict(check)]}


@option_check("hmac")
def check_hmac_options(options: Mapping[str, Any]) -> str | None:
    """Why the ``hmac`` options are unusable (None: usable); never echoes the key's value."""
    key = options.get("key")
    if not key:
        return 'key: required: a ${VAR} reference to the signing key (e.g. "${RESULT_SIGNING_KEY}")'
    if not isinstance(key, str) or not ENV_REF.match(key):
        return (
            "key: expected a ${VAR} reference (keep the signing key out of the file, e.g. "
            '"${RESULT_SIGNING_KEY}"), got a literal value'
        )
    field = options.get("field", SIGNATURE_FIELD)
    if not isinstance(field, str) or not field:
        return f"field: expected a non-empty string, got {field!r}"
    age = options.get("max_age_s")
    if age is not None and (
        isinstance(age, bool)
        or not isinstance(age, (int, float))
        or not math.isfinite(age)
        or age <= 0
    ):
        return f"max_age_s: expected a number > 0, got {age!r}"
    then, at = options.get("then"), options.get("at")
    if at is not None and (not isinstance(at, str) or not at or then is None):
        return "at: expected a dotted path, with then naming the validator it feeds"
    if isinstance(then, (list, tuple)) and not then:
        return "then: expected a validator or a list of them, got an empty list"
    for one in _listed(then):
        if not (
            isinstance(one, str) or (isinstance(one, Mapping) and isinstance(one.get("name"), str))
        ):
            return f"then: expected a validator name or {{name: ..., options}}, got {one!r}"
        name, inner = _then(one)
        if name not in available_validators():
            known = ", ".join(available_validators())
            return f"then: unknown validator {name!r} (known: {known})"
        problem = options_problem(name, inner)
        if problem is not None:
            return f"then: {problem}"
    return None


def _at(value: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise KeyError(path)
    return value


@validator(SIGNED)
def hmac_payload(
    payload: Any,
    key: str = "",
    field: str = SIGNATURE_FIELD,
    then: Any = None,
    at: str | None = None,
    max_age_s: float | None = None,
) -> ValidationResult:
    """Accept a payload carrying a good HMAC-SHA256 signature (:mod:`gpuhedge_celery.signing`)
    under the key in ``key``'s variable, then, with ``then``, what each of its validators
    accepts."""
    options = {"key": key, "field": field, "then": then, "at": at, "max_age_s": max_age_s}
    problem = check_hmac_options({k: v for k, v in options.items() if v is not None})
    if problem is not None:
        return ValidationResult.failed(f"hmac: {problem}")
    var = ENV_REF.match(key).group(1)  # type: ignore[union-attr]
    secret = os.environ.get(var) or ""
    if not secret:
        return ValidationResult.failed(
            f"hmac: the signing key ${{{var}}} is not set on this worker"
        )
    if len(secret.encode("utf-8")) < MIN_KEY_BYTES:
        return ValidationResult.failed(
            f"hmac: the signing key ${{{var}}} is shorter than {MIN_KEY_BYTES} bytes"
        )
    problem = signature_problem(payload, secret, field)
    if problem is not None:
        return ValidationResult.failed(problem)
    if max_age_s is not None:
        signed_at = payload.get(SIGNED_AT_FIELD)
        if isinstance(signed_at, bool) or not isinstance(signed_at, (int, float)):
            return ValidationResult.failed(
                f"signature carries no {SIGNED_AT_FIELD!r} time (max_age_s is set)"
            )
        age = time.time() - signed_at
        if abs(age) > max_age_s:
            when = f"{age:.0f} s ago" if age > 0 else f"{-age:.0f} s in the future"
            return ValidationResult.failed(f"signed {when}, beyond max_age_s {max_age_s:g}")
    if then is None:
        return ValidationResult.passed(signed=True)
    value: Any = {k: v for k, v in payload.items() if k != field}
    if at is not None:
        try:
            value = _at(value, at)
        except KeyError:
            return ValidationResult.failed(f"no field {at!r} in the signed payload")
    verdicts = [validate(name, value, **inner) for name, inner in map(_then, _listed(then))]
    details: dict[str, Any] = {}
    for verdict in verdicts:
        details.update(verdict.details)
    reasons = tuple(reason for verdict in verdicts for reason in verdict.reasons)
    return ValidationResult(all(v.ok for v in verdicts), reasons, {**details, "signed": True})


SIGNATURE_PROVES_END = "signature_proves_end"  # a stored spec's flag, set from the config only


def signature_of(payload: Any, spec: Mapping[str, Any]) -> Any:
    """The signature ``payload`` carries under the race's ``hmac`` options (None: none)."""
    field = (spec.get("validator_options") or {}).get("field", SIGNATURE_FIELD)
    return payload.get(field) if isinstance(payload, Mapping) else None


def signature_verified(payload: Any, spec: Mapping[str, Any]) -> bool:
    """Whether a race whose validator is ``hmac`` (``spec``: the race's stored spec) finds
    ``payload`` signed with its key: the user's function produced it, whatever ``then`` says
    of its content. False for any other validator."""
    if spec.get("validator") != SIGNED:
        return False
    kept = ("key", "field", "max_age_s")  # the signature's own options, not its content's
    options = {k: v for k, v in (spec.get("validator_options") or {}).items() if k in kept}
    return bool(hmac_payload(payload, **options).ok)
