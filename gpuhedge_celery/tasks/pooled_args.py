"""``pooled_infer``'s own arguments, checked the same way on both paths a request can take.

The coordination worker's ``pooled_infer`` refuses bad ones with this one-line error; a caller
sending directly to a free GPU (``tasks/pooled_direct.py``) leaves such a request to it.

The request's size is checked twice against the one limit races have too
(``GPUHEDGE_REQUEST_MAX_BYTES``): by the caller before anything is stored or sent
(``pooled_infer.delay()``, ``send_pooled``), and by ``pooled_infer`` on the worker (a request
sent by name from another app).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ..errors import ConfigError
from ..store import codec
from ..store.keys import check_pool


@lru_cache(maxsize=1)
def request_max_bytes() -> int:
    """``GPUHEDGE_REQUEST_MAX_BYTES`` of this process (its race settings)."""
    from .. import settings

    return settings.current().race.request_max_bytes


def check_request_size(request: Any, max_bytes: int | None = None) -> None:
    """A one-line ConfigError when ``request`` is larger, as compact JSON, than ``max_bytes``
    (default: :func:`request_max_bytes`)."""
    limit = request_max_bytes() if max_bytes is None else max_bytes
    try:
        size = codec.size(request)
    except (TypeError, ValueError, RecursionError):
        return  # what this encoder cannot measure, Celery's JSON serializer judges
    if size > limit:
        raise ConfigError(
            f"{size:,} bytes as JSON, over the {limit:,}-byte limit "
            "(GPUHEDGE_REQUEST_MAX_BYTES): send a reference to large data (a URL, an object "
            "key) instead of the data",
            key="request",
        )


def check_arguments(pool: Any, labels: Any, timeout_s: Any) -> None:
    """``pooled_infer``'s own arguments, or a one-line ConfigError naming the bad one."""
    try:
        check_pool(pool)  # it names the hash tag of the pool's keys
    except ValueError as e:
        raise ConfigError(str(e), key="pool") from None
    if labels is not None and (
        not isinstance(labels, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
    ):
        raise ConfigError(f"expected a dict of str to str, got {labels!r}", key="labels")
    if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or timeout_s <= 0):
        raise ConfigError(f"expected seconds > 0, got {timeout_s!r}", key="timeout_s")
