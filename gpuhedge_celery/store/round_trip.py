"""One round trip to Redis around a race's save: the commands that ride with it, and who reads
each one's replies.

A step's save carries more than the state: the caller's result, timer arms, budget settlements,
the finish. Each is a *rider*: a function that queues its commands on the pipeline, the scripts
they use, and optionally a handler given exactly the replies of those commands once the save has
won. The store sends the riders ``ahead`` of the save first (data the saved state refers to),
then the save, then the others in the order they were added.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

Queue = Callable[[Any], None]
Take = Callable[[list[Any]], None]


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

    def ahead(self, queue: Queue, scripts: Iterable[Any] = (), take: Take | None = None) -> None:
        """Commands sent before the save (Redis runs a pipeline in order)."""
        self._ahead.append(_Rider(queue, take))
        self._add_scripts(scripts)

    def ride(self, queue: Queue, scripts: Iterable[Any] = (), take: Take | None = None) -> None:
        """Commands sent after the save, in the order riders were added. They run whether or
        not the save wins, so each must be harmless when it loses or check the save's mark."""
        self._after.append(_Rider(queue, take))
        self._add_scripts(scripts)

    def ahead_only(self) -> RoundTrip:
        """A new round trip with this one's ``ahead`` riders: a step tried again after a
        version conflict sends the caller's commands again and decides its own anew."""
        if self._after:
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

    def answer(self, replies: list[Any]) -> None:
        """Hand each rider with a handler the replies of its own commands (the save won)."""
        for rider in (*self._ahead, *self._after):
            if rider.take is not None:
                rider.take(replies[rider.span[0] : rider.span[1]])

    def __bool__(self) -> bool:
        return bool(self._ahead or self._after)

    def _queue(self, pipe: Any, riders: list[_Rider]) -> None:
        for rider in riders:
            first = len(pipe.command_stack)
            rider.queue(pipe)
            rider.span = (first, len(pipe.command_stack))

    def _add_scripts(self, scripts: Iterable[Any]) -> None:
        self.scripts.extend(s for s in scripts if s not in self.scripts)
