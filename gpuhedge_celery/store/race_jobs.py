"""The live provider jobs of a race (mixed into :class:`~.races.RaceStore`).

A submitted provider job is registered under its attempt (its JSON handle) right after the
provider accepted it, so a crash leaves the janitor a handle to cancel rather than an unknown
paid job; before the submit, the attempt's intent is claimed in the same hash (``HSETNX``), so
of two processes about to submit one attempt exactly one does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import codec
from .codec import dumps_dict
from .race_keys import RaceShards, SaveMark
from .round_trip import RoundTrip
from .scripts import queue_script, run_pipeline
from .timers import as_text, store_errors


class RaceJobs:
    """Registration of a race's provider jobs and submit intents."""

    client: Any
    prefix: str
    shards: RaceShards

    _touch: Callable[[Any, str], None]  # RaceLiveness's: the heartbeat, one command
    _submit_intent: Any  # the race_submit_intent script, registered by the store

    def add_job(self, race_id: str, attempt_id: str, handle: dict[str, Any]) -> None:
        """Register a submitted provider job as live (its JSON handle), before anything else.

        Register right after the provider accepted the job, so a crash leaves the janitor a
        handle to cancel rather than an unknown paid job.
        """
        keys = self.shards.race(race_id)
        data = dumps_dict(handle, f"job handle of {race_id!r}/{attempt_id!r}")
        with store_errors(f"registering a job of race {race_id!r}"):
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(keys.jobs, attempt_id, data)
            self._touch(pipe, race_id)
            pipe.execute()

    def claim_submit(
        self, race_id: str, attempt_id: str, intent: dict[str, Any], trip: RoundTrip | None = None
    ) -> dict[str, Any] | None:
        """Record the intent to submit an attempt's job, unless something is recorded already.

        Atomic (``HSETNX``): of two processes about to submit the same attempt, one gets None
        (go ahead) and the other what the first recorded (its intent, or the job's handle).
        ``trip``: more work for the same round trip, after the claim (the attempt's budget
        reservation), its handlers given their replies.
        """
        return self._claim_submit(race_id, attempt_id, intent, with_request=False, trip=trip)[0]

    def claim_submit_with_request(
        self, race_id: str, attempt_id: str, intent: dict[str, Any], trip: RoundTrip | None = None
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """:meth:`claim_submit` and :meth:`request` in one round trip: what was recorded
        (None: go ahead) and the request to submit (None if it is gone)."""
        return self._claim_submit(race_id, attempt_id, intent, with_request=True, trip=trip)

    def _claim_submit(
        self,
        race_id: str,
        attempt_id: str,
        intent: dict[str, Any],
        *,
        with_request: bool,
        trip: RoundTrip | None = None,
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        keys = self.shards.race(race_id)
        data = dumps_dict(intent, f"submit intent of {race_id!r}/{attempt_id!r}")

        riders = trip if trip is not None else RoundTrip()
        at = 0

        def build(pipe: Any) -> None:
            nonlocal at
            riders.queue_ahead(pipe)
            at = len(pipe.command_stack)
            pipe.hsetnx(keys.jobs, attempt_id, data)
            pipe.hget(keys.jobs, attempt_id)
            self._touch(pipe, race_id)  # one command
            if with_request:
                pipe.get(keys.request)
            riders.queue_after(pipe)

        with store_errors(f"claiming the submit of race {race_id!r}"):
            replies = run_pipeline(self.client, build, riders.scripts)
        claimed, found = replies[at], replies[at + 1]
        request = None
        if with_request:
            request = codec.loads(replies[at + 3]) if replies[at + 3] is not None else None
        riders.answer(replies)
        riders.send_won(self.client)
        # ``found == data``: our own intent, set by a first run of the pipeline that stopped at
        # a script the server had to load (run_pipeline runs it again): the claim is ours.
        if claimed or found is None or as_text(found) == data:
            return None, request
        return codec.loads(found), request

    def queue_submit_intent(
        self, pipe: Any, race_id: str, attempt_id: str, intent: dict[str, Any], saved: SaveMark
    ) -> str:
        """Queue :meth:`claim_submit`'s intent on the pipeline of the save that created the
        race, to be recorded only if that save won (``saved``: its mark; a redelivered create
        that conflicts claims nothing). Pass :attr:`submit_intent_script` among the save's
        scripts; read the reply with :meth:`submit_intent_ours`. Returns the intent's JSON."""
        keys = self.shards.race(race_id)
        data = dumps_dict(intent, f"submit intent of {race_id!r}/{attempt_id!r}")
        queue_script(
            pipe, self._submit_intent, [keys.jobs, saved.state_key], [saved.mark, attempt_id, data]
        )
        return data

    @property
    def submit_intent_script(self) -> Any:
        return self._submit_intent

    @staticmethod
    def submit_intent_ours(reply: Any, data: str) -> bool:
        """Whether a queued intent's ``reply`` says the claim is ours (``data``: the intent
        queued): recorded now, or by a first send of the same save."""
        return reply is not None and reply != -1 and as_text(reply) == data

    def remove_job(self, race_id: str, attempt_id: str) -> bool:
        """Forget a job that reached a terminal state; False if it was not registered."""
        with store_errors(f"removing a job of race {race_id!r}"):
            return bool(self.client.hdel(self.shards.race(race_id).jobs, attempt_id))

    def live_jobs(self, race_id: str) -> dict[str, dict[str, Any]]:
        """Attempt id -> job handle of every job of the race still registered as live."""
        with store_errors(f"reading the jobs of race {race_id!r}"):
            raw = self.client.hgetall(self.shards.race(race_id).jobs)
        return {as_text(k): codec.loads(v) for k, v in raw.items()}
