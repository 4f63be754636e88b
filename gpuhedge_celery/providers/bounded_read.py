"""Reading an HTTP response body within a size limit and an overall time limit.

httpx's read timeout bounds each socket read, not the response: a server that drips a byte
at a time holds the calling thread for ever, and a huge body goes into memory whole. Every
adapter that talks HTTP streams its responses through :func:`read_bounded` instead.
:func:`failure_kind` names a failed exchange for the provider metrics.
"""

from __future__ import annotations

import time

import httpx

DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024


class BodyRefused(Exception):
    """The body was refused: ``str()`` says why in one line (no URL, no header values).

    ``too_slow``: it did not complete in time (a transport-like failure, worth a retry where
    the call may be retried); otherwise it is over the size limit."""

    def __init__(self, text: str, *, too_slow: bool = False):
        super().__init__(text)
        self.too_slow = too_slow


def read_bounded(response: httpx.Response, *, limit: int, read_s: float) -> bytes:
    """The body of a streamed ``response``: at most ``limit`` bytes, complete within ``read_s``
    seconds in all, else :class:`BodyRefused`. httpx errors (a dropped connection, a read
    timeout) propagate unchanged."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyRefused(f"response of {int(declared)} bytes is over max_response_bytes ({limit})")
    deadline = time.monotonic() + read_s
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > limit:
            raise BodyRefused(f"response is over max_response_bytes ({limit})")
        chunks.append(chunk)
        if time.monotonic() > deadline:
            raise BodyRefused(
                f"response still incomplete after {read_s:g} s ({size} bytes): too slow",
                too_slow=True,
            )
    return b"".join(chunks)


def failure_kind(exc: BaseException) -> str:
    """The metrics' error kind of an exchange that raised ``exc`` (an httpx error or a
    :class:`BodyRefused`): ``timeout`` (connect, read or the whole body too slow),
    ``protocol`` (a body over the size limit) or ``connection`` (any other transport error)."""
    if isinstance(exc, BodyRefused):
        return "timeout" if exc.too_slow else "protocol"
    return "timeout" if isinstance(exc, httpx.TimeoutException) else "connection"
