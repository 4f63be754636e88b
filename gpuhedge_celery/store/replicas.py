"""Writes that count only once replicas hold them: Redis ``WAIT`` after a race's winner claim
and after a budget reservation (``GPUHEDGE_REDIS_WAIT_REPLICAS``).

Replication is asynchronous: a write the primary acknowledged can be lost when Sentinel
promotes a replica that had not received it. A lost winner claim lets a second attempt win on
the new primary after the caller was handed the first one's result; a lost reservation lets a
job run on money no ledger holds. With :attr:`ReplicaAcks.replicas` above 0 the process that
made such a write sends ``WAIT replicas timeout_ms`` right after it, on the same connection
(the same pipeline: ``WAIT`` covers every earlier write of its connection), and acts on the
write (publishes the winner, launches the job) only once enough replicas hold it. A write
they do not acknowledge is sent again (each is idempotent) and waited for again, a few times,
then :class:`NotAcknowledged` is raised: the store's outage error, so the step is retried
later, and nothing was published or launched on the unacknowledged write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import StoreUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

TRIES = 3  # sends of a write (with its WAIT) before the step gives up for now
BACKOFF_S = 0.05  # before the second send; doubled before each later one


class NotAcknowledged(StoreUnavailable):
    """Fewer replicas than asked acknowledged a write that must survive a failover: whatever
    it was for (publishing a winner, launching a job) has not been done; retry later."""


@dataclass(frozen=True)
class ReplicaAcks:
    """How many replicas must hold a winner or a reservation before it counts (0: none, the
    primary's own acknowledgement is trusted) and how long one ``WAIT`` may take."""

    replicas: int = 0
    timeout_ms: int = 1000
    tries: int = TRIES
    backoff_s: float = BACKOFF_S
    # told of each shortfall (kind, "retried" or "gave_up"): the workers count it as a metric
    on_short: Callable[[str, str], None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if self.timeout_ms <= 0:  # WAIT 0 would block for ever
            raise ValueError(f"timeout_ms must be > 0, got {self.timeout_ms}")
        if self.tries < 1:
            raise ValueError(f"tries must be >= 1, got {self.tries}")

    @property
    def on(self) -> bool:
        return self.replicas > 0

    def queue(self, pipe: Any) -> None:
        """Queue the ``WAIT`` on ``pipe``, after the write it must cover (one command)."""
        pipe.execute_command("WAIT", self.replicas, self.timeout_ms)

    def queue_covering(self, pipe: Any, channel: str) -> None:
        """Queue a ``WAIT`` that covers every write Redis took before it, whichever connection
        made it (two commands; the ``WAIT``'s reply is the last).

        ``WAIT`` is documented to wait for the writes of its own connection: a claim or a save
        sent again and found made writes nothing, and another process's retry never wrote
        that claim at all. A ``PUBLISH`` to ``channel`` (nobody listens) is a write the
        replicas receive, so the ``WAIT`` after it waits for everything the primary held at
        that moment, whoever wrote it."""
        pipe.publish(channel, "")
        self.queue(pipe)

    def held(self, reply: Any) -> bool:
        """Whether a ``WAIT`` reply says enough replicas hold the writes before it."""
        return _count(reply) >= self.replicas

    def fell_short(self, what: str, kind: str, reply: Any, *, last: bool = False) -> None:
        """Say that one ``WAIT`` came back short (a warning and the metric; ``last``: no
        more sends follow)."""
        got = _count(reply)
        if self.on_short is not None:
            self.on_short(kind, "gave_up" if last else "retried")
        log.warning(
            "%s: %d of %d replicas acknowledged it within %d ms; %s",
            what,
            got,
            self.replicas,
            self.timeout_ms,
            "not counted: retried later" if last else "sending it again",
        )

    def until_held(
        self,
        what: str,
        kind: str,
        send: Callable[[], tuple[T, Any]],
        *,
        short: Any = None,
    ) -> T:
        """``send()`` until replicas hold what it writes; returns its outcome.

        ``send`` makes the (idempotent) write with :meth:`queue` after it in the same pipeline
        and returns ``(outcome, the WAIT reply)``, or ``(outcome, None)`` when the outcome
        needs no acknowledgement (nothing of ours to act on). ``short``: the ``WAIT`` reply of
        a first send already made (riding in another round trip) that came back short: it
        counts as the first of :attr:`tries`. Raises :class:`NotAcknowledged` after
        :attr:`tries` sends in all. ``kind`` labels the metric (``winner``, ``reservation``).
        """
        reply: Any = short
        start = 0
        if short is not None:
            start = 1
            self.fell_short(what, kind, short, last=self.tries == 1)
        for n in range(start, self.tries):
            if n:
                time.sleep(self.backoff_s * 2 ** (n - 1))
            outcome, reply = send()
            if reply is None or self.held(reply):
                return outcome
            self.fell_short(what, kind, reply, last=n == self.tries - 1)
        raise NotAcknowledged(
            f"{what}: {_count(reply)} of {self.replicas} replicas acknowledged it within "
            f"{self.timeout_ms} ms ({self.tries} tries); not acted on"
        )


def _count(reply: Any) -> int:
    """The replicas a ``WAIT`` reply counts (an error reply, from a pipeline run without
    raising, counts none)."""
    try:
        return int(reply)
    except (TypeError, ValueError):
        return 0
