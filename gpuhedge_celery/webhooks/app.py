"""The webhook receiver: a plain ASGI application (served by uvicorn, ``gpuhedge-celery
webhooks``).

``POST {base}/{race_id}/{attempt_id}/{token}`` with the provider's JSON body. In order:

- not ``POST`` to a path of at least three segments: 404/405 (``GET /healthz``: 200);
- a token that is not the attempt's (:mod:`.token`): 401, before the body is read, nothing
  changed;
- a body over ``GPUHEDGE_WEBHOOK_MAX_BYTES`` (by its ``content-length`` or as it streams in):
  413; a body not complete :data:`BODY_TIMEOUT_S` after the headers: 408; an empty or non-JSON
  body: 400 (any ``content-type`` is accepted: platforms differ);
- otherwise :func:`~.apply.apply_delivery` on a worker thread, answered once it saved.

Every error is a one-line ``{"error": ...}``; nothing of the body is echoed back. Every answer
carries ``x-gpuhedge-receiver: <pid>``, the receiver process that answered (``--workers N``
runs several on one port: :mod:`.serve`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote

import orjson

from . import token as tokens
from .settings import WebhookSettings

log = logging.getLogger(__name__)

Apply = Callable[[str, str, Any], tuple[int, dict[str, Any]]]
BODY_TIMEOUT_S = 30.0  # a delivery's body follows its headers at once (the headers: guard.py)


class WebhookApp:
    """ASGI callable. ``apply(race_id, attempt_id, body)`` does the work (blocking)."""

    def __init__(self, settings: WebhookSettings, apply: Apply, *, threads: int = 16):
        if not settings.secret:
            raise ValueError("the webhook receiver needs GPUHEDGE_WEBHOOK_SECRET")
        self.settings = settings
        self.apply = apply
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="gpuhedge-webhook")
        self.counts: dict[int, int] = {}
        self._head = [
            (b"content-type", b"application/json"),
            (b"x-gpuhedge-receiver", str(os.getpid()).encode()),
        ]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        code, answer = await self._handle(scope, receive)
        self.counts[code] = self.counts.get(code, 0) + 1
        data = orjson.dumps(answer)
        headers = [*self._head, (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": code, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def _handle(self, scope: dict[str, Any], receive: Any) -> tuple[int, dict[str, Any]]:
        raw = scope.get("raw_path") or scope["path"].encode()
        path = raw.decode("latin-1").split("?", 1)[0]
        parts = [p for p in path.split("/") if p]
        if scope["method"] == "GET" and parts == ["healthz"]:
            return 200, {"ok": True}
        if len(parts) < 3:
            return 404, {"error": "no such route"}
        if scope["method"] != "POST":
            return 405, {"error": "method not allowed (POST only)"}
        race_id, attempt_id, given = (unquote(p) for p in parts[-3:])
        if not tokens.accepted(self.settings, race_id, attempt_id, given):
            return 401, {"error": "unknown or wrong token"}
        limit = self.settings.max_bytes
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            ok = length.isdigit()
            return (
                (413, {"error": f"body over {limit} bytes"})
                if ok
                else (400, {"error": "malformed content-length"})
            )
        body = bytearray()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BODY_TIMEOUT_S
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return 408, {"error": f"body not complete within {BODY_TIMEOUT_S:g} s"}
            if message["type"] == "http.disconnect":
                return 400, {"error": "client went away mid-body"}
            body += message.get("body", b"")
            if len(body) > limit:
                return 413, {"error": f"body over {limit} bytes"}
            if not message.get("more_body"):
                break
        if not body.strip():
            return 400, {"error": "empty body (expected JSON)"}
        try:
            data = orjson.loads(bytes(body))
        except orjson.JSONDecodeError as e:
            return 400, {"error": f"body is not JSON: {_line(str(e))}"}
        try:
            return await loop.run_in_executor(self.pool, self.apply, race_id, attempt_id, data)
        except Exception:  # the store is down, or an adapter bug: the provider may retry
            log.exception("webhook for race %s attempt %s failed", race_id, attempt_id)
            return 503, {"error": "try again"}  # the why is in this process's log


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


def _line(text: str, limit: int = 200) -> str:
    return " ".join(text.split())[:limit]


def build_app(settings: WebhookSettings | None = None, *, threads: int = 16) -> WebhookApp:
    """The receiver of this process's race runtime (its driver, config and Celery effects)."""
    from .. import settings as process_settings
    from ..tasks.race_runtime import runtime
    from .apply import apply_delivery

    settings = settings or process_settings.current().webhooks
    runtime()  # built now: a bad config or Redis URL fails at start, not on the first delivery

    def apply(race_id: str, attempt_id: str, body: Any) -> tuple[int, dict[str, Any]]:
        return apply_delivery(runtime().driver, race_id, attempt_id, body)

    return WebhookApp(settings, apply, threads=threads)
