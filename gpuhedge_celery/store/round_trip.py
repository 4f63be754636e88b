"""One round trip to Redis around a race's save: the commands that ride with it, and who reads
each one's replies.

A step's save carries more than the state: the caller's result, timer arms, budget settlements,
the finish. Each is a *rider*: a function that queues its commands on the pipeline, the scripts
they use, and optionally a handler given exactly the replies of those commands once the save has
won. The store sends the riders ``ahead`` of the save first (data the saved state refers to),
then the save, then the others in the order they were added.

Some riders write keys on another slot than the race's (the budget ledger's ``{budget}``), and
act only if the save wins (a script that checks the save's mark). On one Redis they ride in
the same pipeline and check the mark there, so nothing costs a round trip; a Redis Cluster
cannot run one pipeline or script across slots, so there they are sent in a round trip of their
own once the save has won (:meth:`RoundTrip.send_won`). A crash between the two leaves their
work to the pass that already covers a lost write (the budget's sweep, a reservation sent again
before a submit).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import StoreError

log = logging.getLogger(__name__)

Queue = Callable[[Any], None]
Take = Callable[[list[Any]], None]
# queues a rider that acts only if the save wins: ``known`` False, it rides in the save's
# pipeline and checks the save's mark; True, it is sent after the save was seen to win
QueueWon = Callable[[Any, bool], None]


@dataclass
class _Rider:
    queue: Queue
    take: Take | None
    span: tuple[int, int] = (0, 0)  # its replies' slice in the pipeline's, set by each build


@dataclass
class RoundTrip:
    """Riders of one save; build a new one for each try of a step (see :meth:`ahead_only`)."""

    scripts: list[Any] = field(default_factory=list)
    _ahead: list[_Rider] = field(default_factory=list)
    _after: list[_Rider] = field(default_factory=list)
    _won: list[tuple[QueueWon, _Rider]] = field(default_factory=list)
    _won_scripts: list[Any] = field(default_factory=list)
    _split = False  # the won riders wait for a round trip of their own (a cluster pipeline)

    def ahead(self, queue: Queue, scripts: Iterable[Any] = (), take: Take | None = None) -> None:
        """Commands sent before the save (Redis runs a pipeline in order)."""
        self._ahead.append(_Rider(queue, take))
        self._add_scripts(scripts)

    def ride(self, queue: Queue, scripts: Iterable[Any] = (), take: Take | None = None) -> None:
        """Commands sent after the save, in the order riders were added. They run whether or
        not the save wins, so each must be harmless when it loses or check the save's mark."""
        self._after.append(_Rider(queue, take))
        self._add_scripts(scripts)

    def ride_won(
        self, queue: QueueWon, scripts: Iterable[Any] = (), take: Take | None = None
    ) -> None:
        """Commands that act only if the save wins, on keys outside the race's slot: after
        the others in the save's pipeline, checking the save's mark there, on one Redis; in a
        round trip of their own once the save won (:meth:`send_won`) on a cluster. With no
        save in the round trip there is no mark to check: either way they just run."""
        rider = _Rider(lambda pipe: None, take)
        self._won.append((queue, rider))
        scripts = list(scripts)
        self._won_scripts.extend(s for s in scripts if s not in self._won_scripts)
        self._add_scripts(scripts)  # on one Redis they ride in the save's pipeline

    def ahead_only(self) -> RoundTrip:
        """A new round trip with this one's ``ahead`` riders: a step tried again after a
        version conflict sends the caller's commands again and decides its own anew."""
        if self._after or self._won:
            raise ValueError("a round trip handed to a step carries commands ahead of it only")
        again = RoundTrip()
        for rider in self._ahead:
            again.ahead(rider.queue, (), rider.take)
        again._add_scripts(self.scripts)
        return again

    def queue_ahead(self, pipe: Any) -> None:
        self._queue(pipe, self._ahead)

    def queue_after(self, pipe: Any) -> None:
        self._queue(pipe, self._after)
        self._split = _one_slot(pipe)
        if not self._split:
            self._queue_won(pipe, known=False)

    def answer(self, replies: list[Any]) -> None:
        """Hand each rider with a handler the replies of its own commands (the save won)."""
        won = [] if self._split else [r for _, r in self._won]
        for rider in (*self._ahead, *self._after, *won):
            if rider.take is not None:
                rider.take(replies[rider.span[0] : rider.span[1]])

    def send_won(self, client: Any) -> None:
        """After :meth:`answer` (the save won): the won riders a cluster pipeline could not
        carry, in one round trip of their own. Not sent (Redis unreachable, a failover),
        they are logged and left to the pass that covers a lost write."""
        if not (self._split and self._won):
            return
        from .scripts import run_pipeline  # the scripts module builds on this one's callers
        from .timers import store_errors

        try:
            with store_errors("sending what rides on a won save"):
                replies = run_pipeline(client, lambda pipe: self._queue_won(pipe, known=True),
                                       self._won_scripts)  # fmt: skip
        except StoreError as e:
            log.warning("a won save's riders on another slot were not sent (%s)", e)
            return
        for _, rider in self._won:
            if rider.take is not None:
                rider.take(replies[rider.span[0] : rider.span[1]])

    def __bool__(self) -> bool:
        return bool(self._ahead or self._after or self._won)

    def _queue_won(self, pipe: Any, *, known: bool) -> None:
        for queue, rider in self._won:
            first = len(pipe.command_stack)
            queue(pipe, known)
            rider.span = (first, len(pipe.command_stack))

    def _queue(self, pipe: Any, riders: list[_Rider]) -> None:
        for rider in riders:
            first = len(pipe.command_stack)
            rider.queue(pipe)
            rider.span = (first, len(pipe.command_stack))

    def _add_scripts(self, scripts: Iterable[Any]) -> None:
        self.scripts.extend(s for s in scripts if s not in self.scripts)


def _one_slot(pipe: Any) -> bool:
    """Whether ``pipe`` keeps to one slot (a Redis Cluster's), so keys of another slot wait."""
    from .cluster import SlotPipeline

    return isinstance(pipe, SlotPipeline)
