"""Configuration of the ``runpod`` adapter: the ``providers.<name>.runpod`` YAML block.

::

    runpod:
      endpoint_id: "${RUNPOD_ENDPOINT_ID}"
      api_key: "${RUNPOD_API_KEY}"           # must come from the environment
      base_url: https://api.runpod.ai/v2      # the default; tests point it at the fake
      graphql_url: https://api.runpod.io/graphql  # the account API (login-check, costs)
      payload: output.audio_base64            # dotted path of the payload in /status
      policy: {executionTimeout: 600000, ttl: 86400000, lowPriority: false}
      webhook: null                           # a URL template sent with /run (see below)
      timeouts: {connect_s: 5, read_s: 30}  # read_s bounds each whole response
      max_response_bytes: 67108864            # a larger response is a ProviderError (64 MiB)
      poll: {min_s: 0.5, max_s: 2, fraction: 0.2}
      cancel_confirm_s: 10
      health_interval_s: 10
      retries: {attempts: 3, backoff_s: 0.2, max_backoff_s: 5, max_block_s: 0.25}
      rate_limits: {window_s: 10, run: 1000, status: 2000, cancel: 100, use: 0.9,
                    shared: true}

Every key but ``endpoint_id`` and ``api_key`` is optional. Strings keep their ``${VAR}``
references here; they are resolved when the provider is built (docs/providers.md).
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .bounded_read import DEFAULT_MAX_RESPONSE_BYTES
from .options import Block
from .ratelimit import RouteLimit

DEFAULT_BASE_URL = "https://api.runpod.ai/v2"
DEFAULT_GRAPHQL_URL = "https://api.runpod.io/graphql"
ROUTES = ("run", "status", "cancel")
DOCUMENTED_LIMITS = {"run": 1000, "status": 2000, "cancel": 100}  # per endpoint, per 10 s
WEBHOOK_FIELDS = ("race_id", "attempt_id", "token")
_ENV_ONLY = re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*(?::-[^}]*)?\}\Z")


@dataclass(frozen=True)
class PollSpec:
    """How the race's watch is paced with webhooks off (see ``RunpodProvider.next_poll_at``)."""

    min_s: float = 0.5
    max_s: float = 2.0
    fraction: float = 0.2


@dataclass(frozen=True)
class RetrySpec:
    """Retries of status and cancel calls on 429, 5xx and transport errors (never of /run)."""

    attempts: int = 3
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    max_block_s: float = 0.25  # a status call (a cutover's, a submit) waits at most this long


@dataclass(frozen=True)
class RunpodSpec:
    """A parsed ``runpod:`` block."""

    endpoint_id: str
    api_key: str
    base_url: str = DEFAULT_BASE_URL
    graphql_url: str = DEFAULT_GRAPHQL_URL
    payload: str = "output"
    policy: Mapping[str, Any] = field(default_factory=dict)
    webhook: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    poll: PollSpec = PollSpec()
    cancel_confirm_s: float = 10.0
    cancel_poll_s: float = 0.25
    health_interval_s: float = 10.0
    retries: RetrySpec = RetrySpec()
    limits: Mapping[str, RouteLimit] = field(default_factory=dict)
    shared_limits: bool = True
    where: str = ""
    file: str | None = None

    @classmethod
    def from_block(cls, block: Block) -> RunpodSpec:
        endpoint_id = block.string("endpoint_id")
        api_key = block.string("api_key")
        if not _ENV_ONLY.match(api_key.strip()):
            raise block.error(
                "api_key",
                "expected a ${VAR} reference (keep the key out of the "
                'file, e.g. "${RUNPOD_API_KEY}"), got a literal value',
            )
        base_url = block.string("base_url", DEFAULT_BASE_URL).rstrip("/")
        if not base_url.startswith(("http://", "https://", "${")):
            raise block.error("base_url", f"expected an http(s):// URL, got {base_url!r}")
        graphql_url = block.string("graphql_url", DEFAULT_GRAPHQL_URL).strip()
        if not graphql_url.startswith(("http://", "https://", "${")):
            raise block.error("graphql_url", f"expected an http(s):// URL, got {graphql_url!r}")
        spec = cls(
            endpoint_id=endpoint_id,
            api_key=api_key,
            base_url=base_url,
            graphql_url=graphql_url,
            payload=block.string("payload", "output"),
            policy=_policy(block.mapping("policy")),
            webhook=_webhook(block),
            **_timeouts(block.mapping("timeouts")),
            max_response_bytes=block.number(
                "max_response_bytes", DEFAULT_MAX_RESPONSE_BYTES, integer=True, minimum=1
            ),
            poll=_poll(block.mapping("poll")),
            cancel_confirm_s=block.number("cancel_confirm_s", 10.0, positive=True),
            cancel_poll_s=block.number("cancel_poll_s", 0.25, positive=True),
            health_interval_s=block.number("health_interval_s", 10.0, positive=True),
            retries=_retries(block.mapping("retries")),
            **_limits(block.mapping("rate_limits")),
            where=block.where,
            file=block.file,
        )
        block.finish()
        return spec


def _policy(block: Block) -> dict[str, Any]:
    """RunPod's job policy, sent with every /run as written (milliseconds)."""
    out: dict[str, Any] = {}
    if block.has("executionTimeout"):
        out["executionTimeout"] = block.number("executionTimeout", integer=True, minimum=5001)
    if block.has("ttl"):
        out["ttl"] = block.number("ttl", integer=True, minimum=10_000)
    if block.has("lowPriority"):
        out["lowPriority"] = block.boolean("lowPriority")
    block.finish()
    return out


def _webhook(block: Block) -> str | None:
    """A URL template: ``{race_id}``, ``{attempt_id}`` and ``{token}`` are filled per job by
    whoever submits with a context (the webhook receiver); without one no webhook is sent."""
    url = block.string("webhook", None)
    if url is None:
        return None
    if not url.startswith(("https://", "http://", "${")):
        raise block.error("webhook", f"expected an http(s):// URL template, got {url!r}")
    bare = re.sub(r"\$\{[^}]*\}", "", url)  # ${ENV} references are resolved at build
    try:
        names = [n for _, n, _, _ in string.Formatter().parse(bare) if n is not None]
    except ValueError as e:
        raise block.error("webhook", f"malformed URL template: {e}") from None
    unknown = [n for n in names if n not in WEBHOOK_FIELDS]
    if unknown:
        known = ", ".join("{" + n + "}" for n in WEBHOOK_FIELDS)
        raise block.error("webhook", f"unknown placeholder {{{unknown[0]}}} (known: {known})")
    return url


def _timeouts(block: Block) -> dict[str, Any]:
    out = {
        "connect_timeout_s": block.number("connect_s", 5.0, positive=True),
        "read_timeout_s": block.number("read_s", 30.0, positive=True),
    }
    block.finish()
    return out


def _poll(block: Block) -> PollSpec:
    spec = PollSpec(
        min_s=block.number("min_s", 0.5, positive=True),
        max_s=block.number("max_s", 2.0, positive=True),
        fraction=block.number("fraction", 0.2, positive=True, maximum=1.0),
    )
    if spec.max_s < spec.min_s:
        raise block.error(
            "max_s", f"expected a number >= min_s ({spec.min_s:g}), got {spec.max_s:g}"
        )
    block.finish()
    return spec


def _retries(block: Block) -> RetrySpec:
    spec = RetrySpec(
        attempts=block.number("attempts", 3, integer=True, minimum=0, maximum=20),
        backoff_s=block.number("backoff_s", 0.2, positive=True),
        max_backoff_s=block.number("max_backoff_s", 5.0, positive=True),
        max_block_s=block.number("max_block_s", 0.25, minimum=0.0),
    )
    block.finish()
    return spec


def _limits(block: Block) -> dict[str, Any]:
    window_s = block.number("window_s", 10.0, positive=True)
    use = block.number("use", 0.9, positive=True, maximum=1.0)
    limits = {
        route: RouteLimit(
            route, block.number(route, default, integer=True, minimum=2), window_s, use
        )
        for route, default in DOCUMENTED_LIMITS.items()
    }
    shared = block.boolean("shared", True)
    block.finish()
    return {"limits": limits, "shared_limits": shared}
