"""Key names for distributed races and durable timers.

Races live on shards (:class:`RaceShards`), each a Redis Cluster hash tag: a race's keys
(``<prefix>:race:{<tag>}:<race_id>:<part>``), its shard's indexes (races in flight, recently
finished, the record stream: ``<prefix>:{<tag>}:live`` ...) and its shard's timers
(:func:`timer_keys` of the tag) all share the slot of ``{<tag>}``, so every script and pipeline
of one race touches one slot. A race's shard is fixed by its id; readers of the indexes read
every shard. With one shard the tag is the timer namespace itself (``races``).
"""

from __future__ import annotations

import functools
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from .keys import under

# A race id or timer namespace becomes part of a hash tag: braces would break the tag, and
# whitespace or control characters make keys unreadable in redis-cli.
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,200}\Z")


def check_name(value: str, what: str) -> str:
    """Return ``value`` if it is safe inside a key's hash tag, else raise ``ValueError``."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(
            f"invalid {what} {value!r}: expected 1-200 letters, digits, '_', '-', '.' or ':'"
        )
    return value


MAX_SHARDS = 64  # race shards a deployment may run (each a slot, so at most that many busy nodes)


@functools.lru_cache(maxsize=64, typed=True)  # a pure search, done again for every RaceShards built
def shard_tags(base: str, count: int) -> tuple[str, ...]:
    """The hash tags of ``count`` race shards named after ``base`` (the timer namespace).

    One shard keeps ``base`` itself. With more, shard ``k`` is ``<base>-<k>.<n>`` with the
    smallest ``n`` whose Cluster slot lies in the ``k``-th of ``count`` equal slot ranges, so
    a cluster whose primaries own equal slot ranges (what ``redis-cli --cluster create`` and
    ``rebalance`` give) gets an equal share of shards on each primary when ``count`` is a
    multiple of the number of primaries.
    """
    check_name(base, "timer namespace")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SHARDS:
        raise ValueError(f"race shards must be a whole number 1-{MAX_SHARDS}, got {count!r}")
    if count == 1:
        return (base,)
    tags = []
    width = REDIS_CLUSTER_HASH_SLOTS / count
    for k in range(count):
        low, high = int(k * width), int((k + 1) * width)
        n = 0
        while not low <= key_slot(f"{base}-{k}.{n}".encode()) < high:
            n += 1
        tags.append(f"{base}-{k}.{n}")
    return tuple(tags)


def shard_of(race_id: str, count: int) -> int:
    """The shard (``0 <= k < count``) race ``race_id`` lives on, the same in every process."""
    return zlib.crc32(race_id.encode()) % count


@dataclass(frozen=True)
class TimerKeys:
    """The keys of one timer namespace (all on the slot of ``{namespace}``)."""

    due: str  # ZSET timer id -> due epoch ms
    inflight: str  # ZSET timer id -> claim lease deadline epoch ms
    data: str  # HASH timer id -> JSON {"key", "due", "payload"}
    deliveries: str  # HASH timer id -> how many times it was claimed
    seq: str  # STRING counter giving timer ids their sequence number
    channel: str  # pub/sub channel announcing a new earliest timer
    chains: str  # HASH chain key -> id of the chain's newest timer (a job's watch polls)


def timer_keys(prefix: str, namespace: str = "timers") -> TimerKeys:
    """Key names of the timer namespace ``namespace`` under ``prefix``."""
    check_name(namespace, "timer namespace")
    base = under(prefix, f"{{{namespace}}}")
    return TimerKeys(
        due=f"{base}:due",
        inflight=f"{base}:inflight",
        data=f"{base}:data",
        deliveries=f"{base}:deliveries",
        seq=f"{base}:seq",
        channel=f"{base}:wake",
        chains=f"{base}:chains",
    )


@dataclass(frozen=True)
class RaceKeys:
    """The keys of one race (all on the slot of its shard's tag)."""

    state: str  # HASH {"v": version, "data": JSON state, TOLD_FIELD: what its caller is told}
    winner: str  # STRING attempt id of the one winner
    jobs: str  # HASH attempt id -> JSON provider job handle (live jobs only)
    owner: str  # STRING "token|owner" with a PX lease
    owner_seq: str  # STRING fencing counter for owner tokens
    receipt: str  # STRING JSON receipt, with a TTL
    request: str  # STRING the caller's request as compact JSON, written once, gone at finish

    def all(self) -> tuple[str, ...]:
        """Every key of the race, for expiry and clean-up."""
        return (
            self.state,
            self.winner,
            self.jobs,
            self.owner,
            self.owner_seq,
            self.receipt,
            self.request,
        )


# The field of a race's state hash that decides, once, what its caller is told ("won" or
# "failed"), with replicas to wait for: saves leave it alone (race_save.lua).
TOLD_FIELD = "told"
TOLD_WON, TOLD_FAILED = "won", "failed"  # the values tell-once decides between


def race_key_head(prefix: str) -> str:
    """What every key of every race under ``prefix`` starts with; the shard's tag follows."""
    return under(prefix, "race:{")


def race_key_part(prefix: str, key: str) -> tuple[str, str] | None:
    """``(race id, part)`` of a race's key (part: ``state``, ``receipt``...), else None.

    A race id may hold ':', so the part is read from the right."""
    head = race_key_head(prefix)
    if not key.startswith(head):
        return None
    _tag, sep, rest = key[len(head) :].partition("}:")
    race_id, colon, part = rest.rpartition(":")
    return (race_id, part) if sep and colon and race_id and part else None


def race_keys_pattern(prefix: str, id_prefix: str = "") -> str:
    """The SCAN pattern of the keys of races (on any shard) whose id starts with ``id_prefix``."""
    return f"{race_key_head(prefix)}*}}:{id_prefix}*"


def race_keys(prefix: str, tag: str, race_id: str) -> RaceKeys:
    """Key names of race ``race_id`` on the shard tagged ``tag`` under ``prefix``
    (:meth:`RaceShards.race` picks the tag)."""
    check_name(race_id, "race id")
    base = f"{race_key_head(prefix)}{tag}}}:{race_id}"
    return RaceKeys(
        state=f"{base}:state",
        winner=f"{base}:winner",
        jobs=f"{base}:jobs",
        owner=f"{base}:owner",
        owner_seq=f"{base}:owner_seq",
        receipt=f"{base}:receipt",
        request=f"{base}:request",
    )


@dataclass(frozen=True)
class ShardIndexes:
    """The cross-race structures of one shard (all on the slot of ``{tag}``, beside its
    races' keys and its timers, so a race's finish writes them in the race's own script)."""

    tag: str
    live: str  # ZSET race id -> last heartbeat epoch ms, read by the janitor
    finished: str  # ZSET race id -> finish epoch ms of recently finished races (``watch --all``,
    # receipt lookups by id prefix), trimmed to the newest RECENT_FINISHED and the receipt TTL
    records: str  # STREAM of finished races' compact records (one entry per race)


def shard_indexes(prefix: str, tag: str) -> ShardIndexes:
    """Key names of the indexes of the shard tagged ``tag`` under ``prefix`` (not the timer
    names of :func:`timer_keys`, which share the tag)."""
    base = under(prefix, f"{{{tag}}}")
    return ShardIndexes(
        tag=tag, live=f"{base}:live", finished=f"{base}:finished", records=f"{base}:records"
    )


RECENT_FINISHED = 1000  # finished races the index above remembers


def replica_wait_channel(prefix: str) -> str:
    """Pub/sub channel nobody listens to: a ``PUBLISH`` there before a ``WAIT`` is a write the
    replicas receive (``ReplicaAcks.queue_covering``)."""
    return under(prefix, "replicas:wait")


@dataclass(frozen=True)
class BudgetKeys:
    """The budget ledger's keys (all on the slot of ``{budget}``, so one script reserves)."""

    totals: str  # HASH "r|<scope>" / "s|<scope>" -> reserved / spent nano-dollars
    open: str  # ZSET reservation id -> epoch ms after which the janitor may settle it
    ledger: str  # STREAM of reservations, refusals, settlements and reconciliations
    base: str  # prefix of the per-reservation and per-request keys below

    def reservation(self, reservation_id: str) -> str:
        """STRING: one reservation's JSON record (kept a while after it settles)."""
        return f"{self.base}:res:{reservation_id}"

    def request(self, race_id: str) -> str:
        """STRING: nano-dollars one race has reserved or spent (the per-request cap's counter)."""
        return f"{self.base}:req:{race_id}"


def budget_keys(prefix: str) -> BudgetKeys:
    """Key names of the budget ledger under ``prefix``."""
    base = under(prefix, "{budget}")
    return BudgetKeys(
        totals=f"{base}:totals", open=f"{base}:open", ledger=f"{base}:ledger", base=base
    )


def reservation_id(race_id: str, attempt_id: str) -> str:
    """The id of an attempt's reservation (one per attempt: reserving again is a no-op)."""
    check_name(race_id, "race id")
    return f"{race_id}/{attempt_id}"


class SaveMark(NamedTuple):
    """The mark a won save leaves on its race's state (see ``RaceStore.save_mark``), which a
    command riding in that save's pipeline checks to act only if the save won."""

    state_key: str
    mark: str  # "version:save id"


class ResultWrite(NamedTuple):
    """A caller's result, encoded as its result backend stores it, to be written by the claim
    that makes the winner (:meth:`RaceStore.queue_claim_winner`): ``key`` is set to ``value``
    (expiring after ``expires_ms``, 0: never) and ``value`` published on the key's channel,
    as the backend's own write would."""

    key: str
    value: bytes | str
    expires_ms: int = 0


class RaceShards:
    """Where races live: ``count`` shards, each one hash tag holding its races' keys, its
    timers and its indexes (live races, recently finished, records), so every script and
    pipeline of a race touches one Cluster slot. A race's shard is fixed by its id
    (:func:`shard_of`); every process of a deployment must use the same ``count``.
    """

    def __init__(self, prefix: str, namespace: str = "races", count: int = 1):
        self.prefix = prefix
        self.namespace = namespace
        self.tags = shard_tags(namespace, count)
        self.indexes = tuple(shard_indexes(prefix, tag) for tag in self.tags)
        self._index_of = dict(zip(self.tags, self.indexes, strict=True))

    @property
    def count(self) -> int:
        return len(self.tags)

    def tag_of(self, race_id: str) -> str:
        """The hash tag of ``race_id``'s shard."""
        return self.tags[shard_of(check_name(race_id, "race id"), len(self.tags))]

    def race(self, race_id: str) -> RaceKeys:
        """Key names of race ``race_id`` (on its shard's slot)."""
        return race_keys(self.prefix, self.tag_of(race_id), race_id)

    def index_of(self, race_id: str) -> ShardIndexes:
        """The indexes of ``race_id``'s shard (the same slot as its keys)."""
        return self._index_of[self.tag_of(race_id)]

    def by_shard(self, race_ids: Iterable[str]) -> dict[str, list[str]]:
        """``race_ids`` grouped by their shard's tag (each list in the given order, no repeats):
        one pipeline per group keeps to one slot."""
        groups: dict[str, list[str]] = {}
        for race_id in dict.fromkeys(race_ids):
            groups.setdefault(self.tag_of(race_id), []).append(race_id)
        return groups
