"""Slow and idle clients cannot starve the receiver: a header deadline and a connection cap.

uvicorn bounds the idle time between requests on a kept-alive connection, but not how long a
client may take to send a request's headers: a client that opens a connection and sends a
byte now and then holds a socket (a file descriptor) for ever, and enough of them leave no
descriptor for a provider's delivery or for ``/healthz``. :func:`guarded_protocol` wraps the
HTTP protocol uvicorn would use with two rules:

* **header deadline**: a request's headers must be complete :data:`HEADER_TIMEOUT_S` after the
  connection opened, or after the first bytes of a later request on a kept-alive connection;
  else the connection is closed (an idle kept-alive connection is uvicorn's keep-alive
  timeout's to close);
* **connection cap**: at most :func:`connection_cap` connections at once, half of what the
  process's descriptor limit leaves: the event loop accepts up to the listen backlog (set to
  the cap) at a time before any of them is seen, so cap + backlog stays under the limit and
  ``accept`` never fails for want of a descriptor. A connection past the cap closes the
  oldest connection that is still waiting for its headers, or, when every connection is busy
  with a real request, is closed itself (an idle kept-alive connection counts as waiting).
  So the newest client (a provider's delivery, a health probe) gets in.

The body has its own deadline in the application (:data:`~.app.BODY_TIMEOUT_S`).
"""

from __future__ import annotations

import resource
from collections import OrderedDict
from typing import Any

HEADER_TIMEOUT_S = 10.0  # a provider's client sends its request line and headers at once
MAX_CONNECTIONS = 2048
FD_RESERVE = 64  # descriptors kept for Redis, the broker, logs and the listening sockets


def raise_fd_limit() -> int:
    """Raise this process's soft descriptor limit to its hard limit; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 2**31
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(fd_limit: int) -> int:
    """How many client connections to hold at once under a descriptor limit of ``fd_limit``
    (also the listen backlog: see the module's docstring)."""
    return max(16, min(MAX_CONNECTIONS, (fd_limit - FD_RESERVE) // 2))


def guarded_protocol(cap: int, header_timeout_s: float = HEADER_TIMEOUT_S) -> type:
    """uvicorn's HTTP protocol class (httptools where installed, else h11) with the rules
    above; pass it as ``uvicorn.Config(http=...)``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    waiting: OrderedDict[Any, None] = OrderedDict()  # connections still owing their headers

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _deadline: Any = None
        _armed_cycle: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > cap:
                oldest = next(iter(waiting), None)
                if oldest is None:  # every connection is serving a request: refuse this one
                    transport.close()
                    return
                oldest._close("connection cap")
            self._arm()

        def data_received(self, data: bytes) -> None:
            between = self._between_requests()
            super().data_received(data)
            if self._deadline is not None and self.cycle is not self._armed_cycle:
                self._disarm()  # a new request's headers are complete
            elif self._deadline is None and between and self._between_requests():
                self._arm()  # a later request on a kept-alive connection owes its headers

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                waiting[self] = None  # idle: the first to go when a new connection needs room

        def _between_requests(self) -> bool:
            return self.cycle is None or bool(getattr(self.cycle, "response_complete", False))

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._armed_cycle = self.cycle
            self._deadline = self.loop.call_later(header_timeout_s, self._close, "headers")
            waiting[self] = None

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            waiting.pop(self, None)

        def _close(self, _why: str) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedHTTPProtocol
