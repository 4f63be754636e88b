"""The Redis side of a distributed race: versioned state, the winner claim, live jobs, receipts.

Everything here is generic (race ids, attempt ids, JSON blobs) so the coordinator can put the
race engine's serialised state machine on top:

* **state** is saved with optimistic concurrency: a save names the version it read, and a Lua
  script refuses it if anyone saved since, so two coordinators (or a redelivered task) can never
  both advance a race from the same version;
* **the winner** is claimed with set-if-absent: exactly one attempt ever wins, and the same
  attempt claiming again (a duplicate delivery) is told it won; with replicas to wait for
  (:mod:`.replicas`), a claim counts only once they acknowledge it;
* **live provider jobs** are registered per race, for the janitor (:mod:`.race_jobs`);
* **heartbeats and ownership** (:mod:`.race_liveness`): every race has a heartbeat in its
  shard's live-race ZSET, and an ownership lease with a fencing token that a janitor takes
  before acting;
* **receipts** are kept with a configurable TTL and read by race id (:mod:`.race_receipts`).

All keys of one race, and its shard's indexes (heartbeats, recently finished, records), share
the hash tag of the race's shard (:class:`~.race_keys.RaceShards`), so every script and
pipeline of one race touches one slot. The heartbeat is a hint written next to the scripts:
the janitor re-reads the race's own keys before acting.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.clock import Clock, WallClock
from ..errors import StoreError, StoreUnavailable
from . import codec, race_parts
from .codec import dumps_dict, ms
from .race_copies import Copy, StateCopies
from .race_jobs import RaceJobs
from .race_keys import (
    TOLD_FAILED,
    TOLD_FIELD,
    RaceShards,
    ResultWrite,
    SaveMark,
    replica_wait_channel,
)
from .race_liveness import RaceLiveness
from .race_receipts import RaceReceipts
from .records import DEFAULT_RECORDS_MAXLEN, RecordStream
from .replicas import NotAcknowledged, ReplicaAcks
from .round_trip import RoundTrip
from .scripts import lua_script, queue_script, run_pipeline
from .timers import as_text, store_errors

DEFAULT_RECEIPT_TTL_S = 24 * 3600.0
DEFAULT_STATE_TTL_S = 24 * 3600.0
SAVE_RETRY_S = 30.0  # a save is sent again while Redis is unreachable, for up to this long
SAVE_RETRY_INTERVAL_S = 0.5

log = logging.getLogger(__name__)


class VersionConflict(StoreError):
    """A save named a version that is no longer current: decide again from the race as it is.

    ``read``: the save's script answered with the state there (race_save.lua does), which is
    ``found`` (None: no such race), so the caller need not reload it."""

    def __init__(self, race_id: str, expected: int, current: int):
        self.race_id = race_id
        self.expected = expected
        self.current = current
        self.read = False
        self.found: RaceRecord | None = None
        if expected == 0:
            what = f"race {race_id!r} already exists (version {current})"
        elif current == 0:
            what = f"race {race_id!r} does not exist (expected version {expected})"
        elif current == expected:  # a delta whose base is not the state there (race_parts)
            what = f"race {race_id!r} was saved again at version {current} since it was read"
        else:
            what = f"race {race_id!r} is at version {current}, not {expected}"
        super().__init__(what)


@dataclass(frozen=True)
class RaceRecord:
    """A race's state as loaded, with the version a save must name."""

    race_id: str
    version: int
    state: dict[str, Any]
    cached: bool = False  # from this process's last save (load(fresh=True)), maybe stale


@dataclass(frozen=True)
class WinnerClaim:
    """The answer to a winner claim: ``won`` for the claimer, ``first`` if this claim set it."""

    won: bool
    winner: str
    first: bool


SAVES_KEPT = 8  # the saves race_save.lua keeps in a state's history


def _among(mark: str, saves: list[str]) -> bool:
    """Whether the save ``mark`` ('version:id') is in a state's history ``saves``, or was
    followed by so many later saves that it left it (those built on it)."""
    if mark in saves:
        return True
    version = int(mark.split(":", 1)[0])
    return len(saves) >= SAVES_KEPT and all(int(e.split(":", 1)[0]) > version for e in saves)


def new_save_id() -> str:
    """A fresh id for one save (:meth:`RaceStore.save`)."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Keeping:
    """How long a race's keys live (its receipt, and its state while it runs) and how many
    finished races' records the record stream keeps."""

    receipt_ttl_s: float = DEFAULT_RECEIPT_TTL_S
    state_ttl_s: float | None = DEFAULT_STATE_TTL_S
    records_maxlen: int = DEFAULT_RECORDS_MAXLEN


class RaceStore(RaceJobs, RaceReceipts, RaceLiveness):
    """Races in Redis under ``prefix``: a key prefix (one shard) or the deployment's
    :class:`~.race_keys.RaceShards`, which give every key."""

    def __init__(
        self,
        client: Any,
        prefix: str | RaceShards = "gpuhedge",
        keeping: Keeping | None = None,
        *,
        clock: Clock | None = None,
        acks: ReplicaAcks | None = None,
    ):
        keeping = keeping or Keeping()
        receipt_ttl_s, state_ttl_s = keeping.receipt_ttl_s, keeping.state_ttl_s
        records_maxlen = keeping.records_maxlen
        if receipt_ttl_s <= 0:
            raise ValueError(f"receipt_ttl_s must be > 0, got {receipt_ttl_s}")
        self.client = client
        # where each race's keys and its shard's indexes live (one slot per shard): a key
        # prefix alone is one shard under it (a single Redis's default)
        self.shards = prefix if isinstance(prefix, RaceShards) else RaceShards(prefix)
        self.prefix = prefix = self.shards.prefix
        self.receipt_ttl_s = receipt_ttl_s
        self.state_ttl_s = state_ttl_s
        self.clock = clock or WallClock()
        # replicas that must hold a winner claim before its result is published (0: none)
        self.acks = acks or ReplicaAcks()
        self.wait_channel = replica_wait_channel(prefix)  # its WAITs' PUBLISH
        # finished races' records, a stream per shard
        self.records = RecordStream(client, prefix, records_maxlen, self.shards)
        self._save = lua_script(client, "race_save")
        self._claim_winner = lua_script(client, "race_claim_winner")
        self._owner_claim = lua_script(client, "race_owner_claim")
        self._owner_renew = lua_script(client, "race_owner_renew")
        self._finish = lua_script(client, "race_finish")
        self._submit_intent = lua_script(client, "race_submit_intent")
        self._tell_once = lua_script(client, "race_tell_once")
        # What this process last saved and last read of each race (load(fresh=True), deltas)
        self.copies = StateCopies()

    # -- state -------------------------------------------------------------------------------

    def create(
        self,
        race_id: str,
        state: dict[str, Any],
        request: dict[str, Any] | None = None,
        trip: RoundTrip | None = None,
        save_id: str | None = None,
    ) -> int:
        """Store a new race's first state (version 1); VersionConflict if the race exists.

        ``request``: the caller's request, stored once (compact JSON, its own key, written in
        the same round trip) rather than in the state every step rewrites; read it back with
        :meth:`request` or :meth:`claim_submit_with_request`. :meth:`finish` drops it.
        ``trip`` and ``save_id``: as for :meth:`save` (the first timers and the first submit's
        intent ride in this round trip).
        """
        trip = trip if trip is not None else RoundTrip()
        if request is not None:
            key = self.shards.race(race_id).request
            data = dumps_dict(request, f"request of race {race_id!r}")
            ttl_ms = ms(self.state_ttl_s)

            def store_request(pipe: Any) -> None:
                # NX: a redelivered create (which then conflicts) leaves the first one in place
                pipe.set(key, data, nx=True, px=ttl_ms or None)

            trip.ahead(store_request)
        return self.save(race_id, state, 0, trip, save_id)

    def request(self, race_id: str) -> dict[str, Any] | None:
        """The race's request as :meth:`create` stored it; None once the race has finished
        (or expired), or for a race created without one."""
        with store_errors(f"reading the request of race {race_id!r}"):
            found = self.client.get(self.shards.race(race_id).request)
        return None if found is None else codec.loads(found)

    def queue_deadline(self, pipe: Any, race_id: str, at: float) -> None:
        """Queue keeping the race's deadline (epoch seconds) beside its state, once: callers
        waiting on ``.get()`` read it with :meth:`deadline` (one small read, no JSON)."""
        pipe.hsetnx(self.shards.race(race_id).state, "deadline", repr(float(at)))

    def deadline(self, race_id: str) -> float | None:
        """The race's deadline in epoch seconds; None if unknown (no such race, no deadline)."""
        with store_errors(f"reading the deadline of race {race_id!r}"):
            raw = self.client.hget(self.shards.race(race_id).state, "deadline")
        return None if raw is None else float(as_text(raw))

    def save(
        self,
        race_id: str,
        state: dict[str, Any],
        expected_version: int,
        trip: RoundTrip | None = None,
        save_id: str | None = None,
    ) -> int:
        """Save ``state`` if the race is still at ``expected_version``; returns the new version.

        Raises :class:`VersionConflict` when someone saved since (or, for version 0, the race
        already exists). Also refreshes the race's heartbeat. ``trip``: commands riding in the
        same round trip (:class:`~.round_trip.RoundTrip`), ahead of the save or after it; those
        after run whether or not the save wins, so they must be harmless when it loses
        (idempotent timer arms) or check that it won (:meth:`save_mark`, with the ``save_id``
        given here). Their handlers are given their replies once the save won.
        """
        data = race_parts.encode(state, f"state of race {race_id!r}")
        save_id = save_id or new_save_id()
        trip = trip if trip is not None else RoundTrip()
        at = 0

        def build(pipe: Any) -> None:
            nonlocal at
            trip.queue_ahead(pipe)
            at = len(pipe.command_stack)
            self.queue_save(pipe, race_id, data, expected_version, save_id)
            trip.queue_after(pipe)

        replies = self._send_save(race_id, build, [self._save, *trip.scripts])
        version = self.saved(race_id, replies[at], data, expected_version, save_id)
        trip.answer(replies)
        trip.send_won(self.client)
        return version

    def encode(self, race_id: str, state: dict[str, Any]) -> race_parts.EncodedState:
        """``state`` as :meth:`queue_save` takes it (ValueError when it is not a JSON dict)."""
        return race_parts.encode(state, f"state of race {race_id!r}")

    def queue_save(
        self,
        pipe: Any,
        race_id: str,
        data: race_parts.EncodedState,
        expected_version: int,
        save_id: str,
    ) -> None:
        """Queue one save (the state from :meth:`encode`) and the race's heartbeat on
        ``pipe``: two commands; read the first one's reply with :meth:`saved`. :meth:`save` is
        this in a pipeline of its own; the batched watch loop puts many races' saves in one.

        Only the parts that differ from the expected version, as this process last saved or
        read it, are sent (:mod:`.race_parts`); without that copy, every part."""
        keys = self.shards.race(race_id)
        base = self.copies.base(race_id, expected_version)
        if base is None:
            base_id, changed, gone = "", [x for kv in data.parts.items() for x in kv], list[str]()
        else:
            base_id = base.save_id
            changed, gone = race_parts.delta(base.parts, data.parts)
        # The id lets a save whose answer was lost be sent again and recognised (race_save.lua)
        args = [
            expected_version,
            base_id,
            ms(self.state_ttl_s),
            save_id,
            len(changed) // 2,
            *changed,
            *gone,
        ]
        queue_script(pipe, self._save, [keys.state], args)
        self._touch(pipe, race_id)

    @property
    def save_script(self) -> Any:
        """The script :meth:`queue_save` sends (for :func:`~.scripts.run_pipeline`)."""
        return self._save

    def saved(
        self,
        race_id: str,
        reply: Any,
        data: race_parts.EncodedState,
        expected_version: int,
        save_id: str,
    ) -> int:
        """The new version from a queued save's ``reply`` (remembered as this process's last
        copy of the race), or :class:`VersionConflict` if someone saved since, carrying the
        state the script answered with."""
        ok, version, *there = reply
        if not ok:
            self.copies.forget(race_id)
            conflict = VersionConflict(race_id, expected_version, int(version))
            if there:  # the state hash's fields, flat (HGETALL in the script)
                try:
                    flat = iter(there[0])
                    conflict.found = self._record(race_id, dict(zip(flat, flat, strict=True)))
                    conflict.read = True
                except Exception as e:  # the caller reads it again (and meets the error there)
                    log.warning(
                        "race %s: the state a refused save was answered with does not "
                        "decode (%s); it is read again",
                        race_id,
                        e,
                    )
            raise conflict
        self.copies.keep_saved(race_id, Copy(int(version), save_id, data.parts))
        return int(version)

    def save_mark(self, race_id: str, expected_version: int, save_id: str) -> SaveMark:
        """What a command riding in a save's pipeline checks to act only if that save won:
        the race's state key and the entry the save leaves in its history of saves
        (race_save.lua keeps the last 8 there). A save that lost its version check leaves
        none; one sent again after its answer was lost finds its own."""
        if not save_id:
            raise ValueError("save_id must be a non-empty string")
        state = self.shards.race(race_id).state
        return SaveMark(state, f"{expected_version + 1}:{save_id}")

    def _send_save(
        self, race_id: str, build: Callable[[Any], None], scripts: list[Any]
    ) -> list[Any]:
        """Run a save's pipeline; while Redis is unreachable, send it again (the same save id)
        for up to ``SAVE_RETRY_S``. A save that reached Redis but whose answer was lost must
        not be reported as failed: its step would be re-applied as a duplicate and its actions
        (declaring the winner, cancelling losers) would never run. Sent again, it is answered
        "saved" (race_save.lua), and the caller performs them."""
        give_up = time.monotonic() + SAVE_RETRY_S
        while True:
            try:
                with store_errors(f"saving race {race_id!r}"):
                    return run_pipeline(self.client, build, scripts)
            except StoreUnavailable:
                if time.monotonic() >= give_up:
                    raise
                log.warning(
                    "race %s: save not answered (Redis unreachable); sending it again", race_id
                )
                time.sleep(SAVE_RETRY_INTERVAL_S)

    def load(self, race_id: str, *, fresh: bool = False) -> RaceRecord | None:
        """The race's current state and version, or None if there is no such race.

        ``fresh``: if this process saved the race last, return that state without a round
        trip. It may be stale (another process saved since), so only a caller that saves with a
        version check and reloads on a conflict (the driver's step) may ask for it.
        """
        if fresh:
            found = self.cached(race_id)
            if found is not None:
                return found
        keys = self.shards.race(race_id)
        with store_errors(f"loading race {race_id!r}"):
            fields = self.client.hgetall(keys.state)
        return self._record(race_id, fields)

    def _record(self, race_id: str, fields: dict[Any, Any]) -> RaceRecord | None:
        """The record in a state hash's fields (``HGETALL``); None for no race."""
        version = race_parts.field(fields, "v")
        if version is None:  # only race_save.lua sets it
            return None
        parts = race_parts.parts_of(fields)
        state = race_parts.decode_fields(fields, parts)
        self.copies.keep_read(race_id, int(version), fields, parts)
        return RaceRecord(race_id, int(version), state)

    def cached(self, race_id: str) -> RaceRecord | None:
        """This process's last save of the race, if it keeps one (no round trip; it may be
        stale: for callers that save with a version check, as :meth:`load` with ``fresh``)."""
        found = self.copies.saved_copy(race_id)
        if found is None:
            return None
        return RaceRecord(race_id, found.version, race_parts.decode(found.parts), cached=True)

    def load_many(self, race_ids: list[str]) -> list[RaceRecord | None]:
        """:meth:`load` of several races in one round trip per shard they are on."""
        fields: dict[str, Any] = {}
        with store_errors(f"loading {len(race_ids)} races"):
            for ids in self.shards.by_shard(race_ids).values():
                pipe = self.client.pipeline(transaction=False)
                for race_id in ids:
                    pipe.hgetall(self.shards.race(race_id).state)
                fields.update(zip(ids, pipe.execute(), strict=True))
        return [self._record(race_id, fields[race_id]) for race_id in race_ids]

    def load_with_jobs(self, race_id: str) -> tuple[RaceRecord | None, dict[str, dict[str, Any]]]:
        """:meth:`load` and :meth:`live_jobs` in one round trip."""
        keys = self.shards.race(race_id)
        with store_errors(f"loading race {race_id!r}"):
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(keys.state)
            pipe.hgetall(keys.jobs)
            fields, raw = pipe.execute()
        jobs = {as_text(k): codec.loads(v) for k, v in raw.items()}
        return self._record(race_id, fields), jobs

    def update(
        self,
        race_id: str,
        change: Callable[[dict[str, Any]], dict[str, Any]],
        *,
        attempts: int = 20,
    ) -> RaceRecord:
        """Load, apply ``change`` to the state, save; retried on conflicts. Returns the result.

        ``change`` may run several times (once per conflict), so it must be a pure function of
        the state it is given.
        """
        reread: VersionConflict | None = None
        for _ in range(attempts):
            record = reread.found if reread is not None else self.load(race_id)
            if record is None:
                raise VersionConflict(race_id, 1, 0)
            new_state = change(record.state)
            try:
                version = self.save(race_id, new_state, record.version)
            except VersionConflict as e:  # decide again from the state it was answered with
                reread = e if e.read else None
                continue
            return RaceRecord(race_id, version, new_state)
        raise StoreError(f"race {race_id!r}: gave up after {attempts} conflicting saves")

    # -- the winner --------------------------------------------------------------------------

    def claim_winner(self, race_id: str, attempt_id: str) -> WinnerClaim:
        """Make ``attempt_id`` the race's one winner unless another attempt already is.

        With replicas to wait for (:attr:`acks`), a claim this attempt holds is returned only
        once they acknowledge it (:class:`~.replicas.NotAcknowledged` otherwise)."""
        if not isinstance(attempt_id, str) or not attempt_id:
            raise ValueError(f"invalid attempt id {attempt_id!r}: expected a non-empty string")
        keys = self.shards.race(race_id)
        args = [attempt_id, ms(self.state_ttl_s)]
        if self.acks.on:
            return self._held_claim(race_id, attempt_id, [keys.winner], args)
        with store_errors(f"claiming the winner of race {race_id!r}"):
            won, winner, first = self._claim_winner(keys=[keys.winner], args=args)
        return WinnerClaim(won=bool(won), winner=as_text(winner), first=bool(first))

    def confirm_winner(
        self, race_id: str, attempt_id: str, saved: SaveMark, ridden: WinnerClaim, acked: Any
    ) -> WinnerClaim:
        """A claim that rode in the save marked ``saved`` and won (``ridden``), but whose
        ``WAIT`` (its reply ``acked``) fewer replicas acknowledged than :attr:`acks` asks: sent
        again (the same claim: it still claims only if that save is in Redis) until they do.
        Raises :class:`~.replicas.NotAcknowledged` when they never do, and when the save
        itself is gone (lost in a failover: the step is decided again from Redis)."""
        keys = self.shards.race(race_id)
        claim = self._held_claim(
            race_id,
            attempt_id,
            [keys.winner, saved.state_key],
            [attempt_id, ms(self.state_ttl_s), saved.mark],
            short=acked,
        )
        return WinnerClaim(claim.won, claim.winner, claim.won and (claim.first or ridden.first))

    def _held_claim(
        self, race_id: str, attempt_id: str, keys: list[str], args: list[Any], *, short: Any = None
    ) -> WinnerClaim:
        """The claim (``keys``, ``args``: the script's) with ``WAIT`` after it in one
        pipeline, sent until replicas hold it or another attempt holds the win."""
        what = f"race {race_id}: the win of {attempt_id}"
        first = False

        def send() -> tuple[WinnerClaim, Any]:
            nonlocal first

            def build(pipe: Any) -> None:
                queue_script(pipe, self._claim_winner, keys, args)
                # a claim found made writes nothing: the WAIT must cover it all the same
                self.acks.queue_covering(pipe, self.wait_channel)

            with store_errors(f"claiming the winner of race {race_id!r}"):
                # a WAIT cut short (a failover demoting the primary) counts as none: sent again
                reply, _, acked = run_pipeline(
                    self.client, build, [self._claim_winner], raise_on_error=False
                )
                if isinstance(reply, Exception):
                    raise reply
            claim = self.winner_claim(reply)
            if claim is None:  # the save that declared it is not in Redis (a failover)
                raise NotAcknowledged(
                    f"{what}: the save that declared it is no longer in Redis; decided again"
                )
            first = first or claim.first
            held = WinnerClaim(claim.won, claim.winner, claim.won and first)
            # another attempt's win is not ours to publish: nothing to wait for
            return held, acked if claim.won else None

        try:
            return self.acks.until_held(what, "winner", send, short=short)
        except NotAcknowledged:
            self.copies.forget(race_id)  # the state saved with it may be lost too: read it
            raise

    def queue_claim_winner(
        self,
        pipe: Any,
        race_id: str,
        attempt_id: str,
        saved: SaveMark,
        result: ResultWrite | None = None,
    ) -> None:
        """Queue :meth:`claim_winner` on a save's pipeline, to claim only if that save wins
        (``saved``: its :meth:`save_mark`); read the reply with :meth:`winner_claim`. Pass
        :attr:`claim_winner_script` among the save's scripts.

        ``result``: the caller's result, written by the claim only if it makes the winner
        (first), so neither a losing save nor a resend of this one writes it. The result key
        is in another hash slot than the race's: only where the store's Redis also holds the
        results (the backend's ``won_write`` decides; never on a Redis Cluster store, whose
        results live on a Redis of their own and are written after the save).

        With replicas to wait for (:attr:`acks`) no result rides (it is published once they
        hold the claim) and a ``WAIT`` follows the claim (:meth:`~.replicas.ReplicaAcks.
        queue_covering`: a save sent again after a lost answer writes nothing): three replies,
        the last its count (:meth:`RiddenClaim <gpuhedge_celery.race.outcome.RiddenClaim>`
        reads the first and the last)."""
        keys = self.shards.race(race_id)
        args = [attempt_id, ms(self.state_ttl_s), saved.mark]
        if self.acks.on:
            if result is not None:  # it would reach the caller before the replicas hold it
                raise ValueError("no result rides with a claim that replicas must acknowledge")
            queue_script(pipe, self._claim_winner, [keys.winner, saved.state_key], args)
            self.acks.queue_covering(pipe, self.wait_channel)
            return
        if result is None:
            queue_script(pipe, self._claim_winner, [keys.winner, saved.state_key], args)
            return
        queue_script(
            pipe,
            self._claim_winner,
            [keys.winner, saved.state_key, result.key],
            [*args, result.value, int(result.expires_ms)],
        )

    @property
    def claim_winner_script(self) -> Any:
        return self._claim_winner

    def queue_wait(self, pipe: Any) -> None:
        """Queue a ``WAIT`` covering every write before it (the save it rides with included);
        its reply is the last of the commands queued (:meth:`hold_save` reads it)."""
        self.acks.queue_covering(pipe, self.wait_channel)

    def hold_save(self, race_id: str, saved: SaveMark | None = None, *, short: Any = None) -> None:
        """Return once the replicas :attr:`acks` asks for hold the race's state as saved
        (``saved``: the mark of the save that must be in it; None: the state as last read).
        For a save that failed the race: its caller is told only once no failover can take
        the failure back. ``short``: the reply of a ``WAIT`` that rode in that save and came
        back short (the first of the tries). Raises :class:`~.replicas.NotAcknowledged` when
        they never hold it, and when that save (or the race) is no longer in Redis."""
        state_key = self.shards.race(race_id).state
        what = f"race {race_id}: the save that failed it"

        def send() -> tuple[None, Any]:
            def build(pipe: Any) -> None:
                pipe.hget(state_key, "s")  # the race's last saves (race_save.lua)
                self.acks.queue_covering(pipe, self.wait_channel)

            with store_errors(f"waiting for the replicas to hold race {race_id!r}"):
                history, _, acked = run_pipeline(self.client, build, raise_on_error=False)
                if isinstance(history, Exception):
                    raise history
            saves = as_text(history).split() if history is not None else None
            if saves is None or (saved is not None and not _among(saved.mark, saves)):
                raise NotAcknowledged(f"{what} is no longer in Redis; decided again")
            return None, acked

        try:
            self.acks.until_held(what, "failure", send, short=short)
        except NotAcknowledged:
            self.copies.forget(race_id)  # the state saved may be lost: read it
            raise

    @staticmethod
    def winner_claim(reply: Any) -> WinnerClaim | None:
        """A queued claim's reply as a :class:`WinnerClaim`; None when its save did not win."""
        won, winner, first = reply
        if int(won) < 0:
            return None
        return WinnerClaim(won=bool(won), winner=as_text(winner), first=bool(first))

    def tell_once(self, race_id: str, outcome: str) -> str | None:
        """Decide, atomically and once, what the race's caller is told (``outcome``: "won" or
        "failed"): returns the outcome decided, this one or an earlier teller's; None when the
        race's state is gone (nothing decided).

        With replicas to wait for, a failure decided here is returned once they hold the
        decision (sent again while they come back short): a failover that lost it could
        otherwise let a winner the replicas caught up on be told after the failure. When they
        never hold it the failure is returned all the same (a caller is never left in silence);
        a winner needs no wait here, since its claim is held before it is decided."""
        state = self.shards.race(race_id).state
        what = f"deciding what the caller of race {race_id!r} is told"
        if not self.acks.on or outcome != TOLD_FAILED:
            with store_errors(what):
                found = self._tell_once(keys=[state], args=[TOLD_FIELD, outcome])
            return None if found is None else as_text(found)
        decided: list[str | None] = [None]

        def send() -> tuple[str | None, Any]:
            def build(pipe: Any) -> None:
                queue_script(pipe, self._tell_once, [state], [TOLD_FIELD, outcome])
                self.acks.queue_covering(pipe, self.wait_channel)

            with store_errors(what):
                found, _, acked = run_pipeline(
                    self.client, build, [self._tell_once], raise_on_error=False
                )
                if isinstance(found, Exception):
                    raise found
            decided[0] = None if found is None else as_text(found)
            return decided[0], acked if decided[0] == TOLD_FAILED else None

        try:
            return self.acks.until_held(f"race {race_id}: its failure", "failure", send)
        except NotAcknowledged:
            return decided[0]  # logged by the acks as given up: told all the same

    def told(self, race_id: str) -> str | None:
        """What :meth:`tell_once` decided the race's caller is told; None while undecided."""
        state = self.shards.race(race_id).state
        with store_errors(f"reading what the caller of race {race_id!r} is told"):
            found = self.client.hget(state, TOLD_FIELD)
        return None if found is None else as_text(found)

    def winner(self, race_id: str) -> str | None:
        """The attempt that won the race, None while nobody has."""
        with store_errors(f"reading the winner of race {race_id!r}"):
            found = self.client.get(self.shards.race(race_id).winner)
        return None if found is None else as_text(found)

    def delete(self, race_id: str) -> None:
        """Remove every key of the race and its heartbeat (tests, manual clean-up)."""
        with store_errors(f"deleting race {race_id!r}"):
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(*self.shards.race(race_id).all())
            index = self.shards.index_of(race_id)
            pipe.zrem(index.live, race_id)
            pipe.zrem(index.finished, race_id)
            pipe.execute()
