"""Signing a result inside the user's function, for the ``hmac`` validator to check.

Some deliveries cannot be verified by an authenticated read: Cerebrium's run lookup reports no
result, so its webhook body is all there is, and anyone holding an attempt's webhook URL can
post one; an ``http`` adapter's status answer is whatever that server says. A function that
signs what it returns with a key only it and the workers hold lets the race tell its result
from a forged one (docs/security.md, *Signed results*)::

    from gpuhedge_celery.signing import sign_result

    def predict(text: str) -> dict:
        audio = synthesize(text)
        return sign_result({"audio_base64": audio}, os.environ["RESULT_SIGNING_KEY"])

The signature is ``"v1=" + hex(HMAC-SHA256(key, b"gpuhedge-result-v1\\n" + canonical))``,
where ``canonical`` is the payload object without its signature field as canonical JSON: keys
sorted by code point at every level, no whitespace (``","`` and ``":"`` separators), strings
as UTF-8 (not ``\\u`` escapes), NaN and infinities refused. The key is the UTF-8 bytes of the
text given. Strings and integers round-trip exactly through any JSON hop between the function
and the worker; a float is signed as Python writes it (its shortest round-trip form), so a
function written in another language should put figures in strings or integers.

Pure: the standard library only (no Celery, Redis or provider import), so a GPU function can
import it alone.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from typing import Any

VERSION = "v1"
DOMAIN = b"gpuhedge-result-v1\n"  # binds the MAC to this use: not reusable as another HMAC
SIGNATURE_FIELD = "signature"
SIGNED_AT_FIELD = "signed_at"  # unix seconds, when sign_result(..., timestamp=True)
MIN_KEY_BYTES = 16


def canonical(payload: Mapping[str, Any], field: str = SIGNATURE_FIELD) -> bytes:
    """The bytes a signature covers: ``payload`` less ``field`` as canonical JSON (above)."""
    if not isinstance(payload, Mapping):
        raise TypeError(f"a signed payload is a JSON object, not {type(payload).__name__}")
    body = {k: v for k, v in payload.items() if k != field}
    text = json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )
    return text.encode("utf-8")


def _key_bytes(key: str | bytes) -> bytes:
    data = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    if len(data) < MIN_KEY_BYTES:
        raise ValueError(f"a signing key needs at least {MIN_KEY_BYTES} bytes")
    return data


def signature(payload: Mapping[str, Any], key: str | bytes, field: str = SIGNATURE_FIELD) -> str:
    """``payload``'s signature under ``key`` (``v1=`` and 64 lowercase hex digits)."""
    mac = hmac.new(_key_bytes(key), DOMAIN + canonical(payload, field), hashlib.sha256)
    return f"{VERSION}={mac.hexdigest()}"


def sign_result(
    payload: Mapping[str, Any],
    key: str | bytes,
    *,
    timestamp: bool = False,
    field: str = SIGNATURE_FIELD,
    now: float | None = None,
) -> dict[str, Any]:
    """A copy of ``payload`` (a JSON object) carrying its signature at ``field``.

    ``timestamp``: also sign the time (``signed_at``, whole unix seconds), for a validator
    with ``max_age_s`` to refuse an old signed result replayed into a later race.
    """
    signed = {k: v for k, v in payload.items() if k != field}
    if timestamp:
        signed[SIGNED_AT_FIELD] = int(time.time() if now is None else now)
    signed[field] = signature(signed, key, field)
    return signed


def signature_problem(payload: Any, key: str | bytes, field: str = SIGNATURE_FIELD) -> str | None:
    """Why ``payload`` does not carry a good signature under ``key`` (None: it does). The
    reason never shows the key or the expected signature."""
    if not isinstance(payload, Mapping):
        return (
            f"signature missing: the payload is a {type(payload).__name__}, not a JSON "
            f"object carrying {field!r}"
        )
    _key_bytes(key)  # a short key is the caller's mistake, not the payload's
    given = payload.get(field)
    if given is None:
        return f"signature missing (no {field!r} field)"
    if not isinstance(given, str):
        return "signature does not match"
    try:
        expected = signature(payload, key, field)
    except (TypeError, ValueError) as e:  # not JSON as signed: NaN, a non-string key
        return f"signature does not match (the payload cannot be signed: {type(e).__name__})"
    if not hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8")):
        return "signature does not match"
    return None
