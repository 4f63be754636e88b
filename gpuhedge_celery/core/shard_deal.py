"""Which race shards' timers a coordinator claims, dealt over the coordinators alive.

Every process that fires race timers (a coordinator) holds a lease in a registry; the shards
are dealt over the live leases so that adding a coordinator spreads the claiming instead of
adding one more claimer per shard. The deal is a pure function of the sorted live ids and the
shard count, so every coordinator that reads the same registry reaches the same deal.

Seats: for N coordinators and S shards there are ``max(N, S)`` seats, and seat ``q`` pairs
shard ``q mod S`` with coordinator ``q mod N`` (in sorted order). So every shard has a claimer
and every coordinator a shard; with N <= S each shard has one claimer and a coordinator holds
``S / N`` shards rounded up or down; with more coordinators than shards (one shard on one
Redis, the default) each holds one shard and several claim each shard, as every coordinator
once claimed every shard. Claims are atomic in Redis, so two claimers of one shard never fire
one timer twice; they only spend more claims.
"""

from __future__ import annotations

from collections.abc import Iterable


def dealt_shards(me: str, coordinators: Iterable[str], count: int) -> tuple[int, ...]:
    """The shards (``0 <= k < count``) coordinator ``me`` claims among ``coordinators``.

    ``me`` counts as alive whether or not it is listed (its own lease may have lapsed while
    it could not reach Redis; it still claims its part rather than nothing).
    """
    alive = _alive(me, coordinators, count)
    n = len(alive)
    return tuple(sorted({q % count for q in range(alive.index(me), max(n, count), n)}))


def helped_shards(me: str, coordinators: Iterable[str], count: int) -> tuple[int, ...]:
    """The shards coordinator ``me`` helps with (claims their timers once they are late) among
    ``coordinators``: a shard with one holder is helped by the coordinator after that holder in
    sorted order, so it has one helper and a process helps with about as many shards as it
    holds, however many coordinators there are. A shard with several holders (more
    coordinators than shards) needs none, nor does a coordinator alone."""
    alive = _alive(me, coordinators, count)
    n = len(alive)
    seats = max(n, count)
    mine = alive.index(me)
    # seat q pairs shard q mod count with coordinator q mod n: shard k's seats are k, k + count...
    return tuple(
        k
        for k in range(count)
        if n > 1 and len(range(k, seats, count)) == 1 and (k % n + 1) % n == mine
    )


def _alive(me: str, coordinators: Iterable[str], count: int) -> list[str]:
    """The coordinators in sorted order, ``me`` among them; ValueError for a bad count."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"shard count must be a whole number >= 1, got {count!r}")
    return sorted(set(coordinators) | {me})
