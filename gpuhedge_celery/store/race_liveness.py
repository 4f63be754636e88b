"""A race's liveness in Redis: its heartbeat in its shard's live index and its ownership lease.

Part of :class:`~gpuhedge_celery.store.races.RaceStore`. Every race has a heartbeat in its
shard's live-race ZSET (on the race's slot), so a janitor scanning every shard can find the jobs
of races nobody advances any more; ownership is a lease with a fencing token: a janitor (or a
coordinator holding a race for a while) takes it before acting, which tells a slow owner (lease
renewed) from a dead one. The index is a hint, written next to the race's scripts in the same
pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.clock import Clock
from ..errors import LeaseError
from . import codec
from .race_keys import RaceShards
from .round_trip import RoundTrip
from .scripts import queue_script, run_pipeline
from .timers import as_text, store_errors


class OwnershipLost(LeaseError):
    """The caller's ownership lease on a race expired or was taken over."""

    def __init__(self, race_id: str, token: int):
        self.race_id = race_id
        self.token = token
        super().__init__(f"ownership of race {race_id!r} with token {token} is no longer held")


@dataclass(frozen=True)
class Ownership:
    """An ownership lease on a race; ``token`` strictly increases per race (fencing)."""

    race_id: str
    owner: str
    token: int


@dataclass(frozen=True)
class StaleRace:
    """A race whose heartbeat stopped and that nobody owns: its live jobs need cancelling."""

    race_id: str
    last_seen_ms: int
    live_jobs: dict[str, dict[str, Any]]


class RaceLiveness:
    """Heartbeats and ownership leases of races under ``prefix`` (mixed into RaceStore)."""

    client: Any
    prefix: str
    clock: Clock
    shards: RaceShards
    receipt_ttl_s: float
    _owner_claim: Any
    _owner_renew: Any

    def now_ms(self) -> int:
        return int(self.clock.now() * 1000)

    def _touch(self, pipe: Any, race_id: str) -> None:
        # GT: hosts with skewed clocks never move a heartbeat backwards.
        pipe.zadd(self.shards.index_of(race_id).live, {race_id: self.now_ms()}, gt=True)

    def queue_touch(self, pipe: Any, race_id: str) -> None:
        """Queue :meth:`touch`'s one command on a pipeline of the caller's."""
        self._touch(pipe, race_id)

    def touch(self, race_id: str, trip: RoundTrip | None = None) -> None:
        """Record that the race is being advanced (its heartbeat for the janitor), with the
        commands ``trip`` carries in the same round trip (its ahead ones first)."""
        trip = trip if trip is not None else RoundTrip()

        def build(pipe: Any) -> None:
            trip.queue_ahead(pipe)
            self._touch(pipe, race_id)
            trip.queue_after(pipe)

        with store_errors(f"touching race {race_id!r}"):
            trip.answer(run_pipeline(self.client, build, trip.scripts))
        trip.send_won(self.client)

    def last_seen_ms(self, race_id: str) -> int | None:
        """The race's last heartbeat (epoch ms), None if it is not in the live index."""
        with store_errors(f"reading the heartbeat of race {race_id!r}"):
            score = self.client.zscore(self.shards.index_of(race_id).live, race_id)
        return None if score is None else int(score)

    def forget(self, race_id: str) -> None:
        """Drop the race from the live index (it finished and has no live job left)."""
        with store_errors(f"forgetting race {race_id!r}"):
            self.client.zrem(self.shards.index_of(race_id).live, race_id)

    def stale_races(self, stale_ms: int, limit: int = 100) -> list[StaleRace]:
        """Races whose heartbeat is older than ``stale_ms`` and whose owner lease has lapsed.

        A race with a live owner lease is slow, not dead, and is left out. The index is only a
        hint: a caller should take ownership (:meth:`claim_owner`) before cancelling anything.
        """
        cutoff = self.now_ms() - stale_ms
        oldest: list[tuple[int, str]] = []
        found: dict[str, tuple[Any, Any]] = {}
        with store_errors("scanning stale races"):
            # the oldest ``limit`` over every shard's index, then each shard's races in a pipeline
            for index in self.shards.indexes:
                oldest += [
                    (int(score), as_text(race_id))
                    for race_id, score in self.client.zrangebyscore(
                        index.live, "-inf", cutoff, start=0, num=limit, withscores=True
                    )
                ]
            oldest = sorted(oldest)[:limit]
            for ids in self.shards.by_shard(race_id for _, race_id in oldest).values():
                pipe = self.client.pipeline(transaction=False)
                for race_id in ids:
                    keys = self.shards.race(race_id)
                    pipe.exists(keys.owner)
                    pipe.hgetall(keys.jobs)
                answers = pipe.execute()
                for i, race_id in enumerate(ids):
                    found[race_id] = (answers[2 * i], answers[2 * i + 1])
        stale = []
        for score, race_id in oldest:
            owned, jobs = found[race_id]
            if owned:
                continue
            live = {as_text(k): codec.loads(v) for k, v in jobs.items()}
            stale.append(StaleRace(race_id, score, live))
        return stale

    # -- ownership ---------------------------------------------------------------------------

    def claim_owner(self, race_id: str, owner: str, lease_ms: int) -> Ownership | None:
        """Take the race's ownership lease (or renew our own); None if someone else holds it."""
        if not owner or "|" in owner:
            raise ValueError(f"invalid owner name {owner!r}: non-empty, without '|'")
        keys = self.shards.race(race_id)
        with store_errors(f"claiming race {race_id!r}"):
            ok, token, _holder = self._owner_claim(
                keys=[keys.owner, keys.owner_seq, keys.state],
                args=[owner, lease_ms, int(self.receipt_ttl_s * 1000)],
            )
        return Ownership(race_id, owner, int(token)) if ok else None

    def owner(self, race_id: str) -> Ownership | None:
        """Who holds the race's ownership lease now, None if nobody does."""
        with store_errors(f"reading the owner of race {race_id!r}"):
            held = self.client.get(self.shards.race(race_id).owner)
        if held is None:
            return None
        token, _, owner = as_text(held).partition("|")
        return Ownership(race_id, owner, int(token))

    def renew_owner(self, ownership: Ownership, lease_ms: int) -> None:
        """Extend our lease and refresh the heartbeat; OwnershipLost if it is no longer ours."""
        keys = self.shards.race(ownership.race_id)
        args = [ownership.token, lease_ms, ownership.owner]

        def build(pipe: Any) -> None:
            queue_script(pipe, self._owner_renew, [keys.owner], args)
            self._touch(pipe, ownership.race_id)

        with store_errors(f"renewing race {ownership.race_id!r}"):
            renewed, _ = run_pipeline(self.client, build, [self._owner_renew])
        if not renewed:
            raise OwnershipLost(ownership.race_id, ownership.token)

    def release_owner(self, ownership: Ownership) -> bool:
        """Give the lease up; False if it had already lapsed or been taken over."""
        keys = self.shards.race(ownership.race_id)
        with store_errors(f"releasing race {ownership.race_id!r}"):
            return bool(
                self._owner_renew(keys=[keys.owner], args=[ownership.token, 0, ownership.owner])
            )
