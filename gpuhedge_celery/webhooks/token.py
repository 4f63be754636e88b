"""Per-attempt webhook tokens and URLs.

A job's URL is ``{base}/{race_id}/{attempt_id}/{token}``, the token an HMAC-SHA256 of race and
attempt under ``GPUHEDGE_WEBHOOK_SECRET`` (hex, 128 bits): unguessable, the same on every
process that knows the secret (a retried delivery, another receiver replica), and useless for
any other attempt. Providers do not sign their deliveries, so the URL is the credential.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import quote

from .settings import WebhookSettings

TOKEN_HEX = 32


def token(secret: str, race_id: str, attempt_id: str) -> str:
    message = f"{race_id}\x00{attempt_id}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()[:TOKEN_HEX]


def valid(secret: str, race_id: str, attempt_id: str, given: str) -> bool:
    """Whether ``given`` is the attempt's token (constant time)."""
    if not secret or len(given) != TOKEN_HEX or not given.isascii():
        return False  # (compare_digest refuses non-ASCII text: never a crash on a bad URL)
    return hmac.compare_digest(token(secret, race_id, attempt_id), given)


def accepted(settings: WebhookSettings, race_id: str, attempt_id: str, given: str) -> bool:
    """Whether ``given`` is the attempt's token under the current secret or, while one is
    being rotated out, the previous one."""
    return any(valid(secret, race_id, attempt_id, given) for secret in settings.secrets)


def context(settings: WebhookSettings, race_id: str, attempt_id: str) -> dict[str, str] | None:
    """What a provider's ``submit(request, context=...)`` needs for this attempt's webhook
    (``race_id``, ``attempt_id``, ``token``, and the full ``url``); None with webhooks off."""
    if not settings.on:
        return None
    tok = token(settings.secret, race_id, attempt_id)
    url = f"{settings.url}/{quote(race_id, safe='')}/{quote(attempt_id, safe='')}/{tok}"
    return {"race_id": race_id, "attempt_id": attempt_id, "token": tok, "url": url}
