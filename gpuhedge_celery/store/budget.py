"""The budget ledger in Redis: reservations, settlements, the counters the caps read, the stream.

* :meth:`BudgetStore.prepare` builds one attempt's reservation (``budget_reserve.lua``): its
  worst case checked against every cap that applies and charged to every scope, or refused,
  and a ledger entry either way, in one atomic script. It is queued on a pipeline the caller
  already sends (the submit claim's), so reserving costs no extra round trip. With replicas
  to wait for (:mod:`.replicas`), a ``WAIT`` follows it and a granted reservation counts only
  once they hold it (:meth:`BudgetStore.acknowledged`, before its job is submitted).
* :meth:`BudgetStore.queue_settle` / :meth:`settle` settle reservations to their cost
  (``budget_settle.lua``); a reservation settles once, so one that rides in a race save
  settles only if that save wins.
* The ledger stream holds every reservation, refusal, settlement and reconciliation, in order;
  replaying it rebuilds the counters (``ledger export`` writes it as JSONL).
* :func:`budget_report`: every cap beside what is reserved and spent against it, and the
  headroom (``gpuhedge-celery budget`` prints it; ``metrics serve`` exports it as gauges).

Money is integer nano-dollars (:mod:`gpuhedge_celery.core.budget`). All keys share the hash tag
``{budget}`` (:func:`~gpuhedge_celery.store.race_keys.budget_keys`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.budget import BudgetCaps, refusal_text, to_nano, to_usd
from ..errors import StoreError
from .race_keys import SaveMark, budget_keys, reservation_id
from .replicas import ReplicaAcks
from .round_trip import RoundTrip
from .scripts import lua_script, queue_script, run_pipeline
from .timers import as_text, store_errors

KEEP_S = 7 * 24 * 3600.0  # settled records and per-request counters are kept this long
MAX_NANO = 2**53  # the largest figure the budget scripts take (exact in a Lua number)

GRANTED, REPEAT, SETTLED, REFUSED = 1, 2, 3, 0


@dataclass(frozen=True)
class Reservation:
    """The answer to one reservation: granted (now or before) or refused, and why."""

    id: str
    granted: bool
    amount_nano: int
    repeat: bool = False
    reason: str = ""  # the refusal's one line (receipts, logs)
    cap: str = ""  # which cap refused it


@dataclass
class PendingReservation:
    """A reservation queued on a pipeline; :meth:`take` reads its reply.

    ``cap_name(slot)`` names the cap of a slot (only asked when one refused). With replicas to
    wait for, ``acked`` is the reply of the ``WAIT`` that followed it (:attr:`held`).
    """

    store: BudgetStore
    reservation_id: str
    keys: list[str]
    args: list[Any]
    cap_name: Callable[[int], str]
    result: Reservation | None = None
    acked: Any = None

    def queue(self, pipe: Any) -> None:
        queue_script(pipe, self.store.reserve_script, self.keys, self.args)

    def queue_on_save(self, pipe: Any, saved: SaveMark) -> None:
        """:meth:`queue`, to reserve only if the race save it rides with wins (``saved``: its
        mark; the create of the race, which a redelivery may lose)."""
        queue_script(
            pipe, self.store.reserve_script, [*self.keys, saved.state_key], [*self.args, saved.mark]
        )

    def ride(self, trip: RoundTrip, saved: SaveMark | None = None) -> None:
        """Ride in ``trip``: reserve with its round trip (``saved``: only if the race save it
        rides with wins; on a cluster, in a round trip of its own after the save won), the
        reply read into :attr:`result`; with replicas to wait for, a ``WAIT`` after it, its
        reply read into :attr:`acked`. Not sent, :attr:`result` stays None (not held)."""

        def queue(pipe: Any, known: bool) -> None:
            self._queue_held(pipe, None if known else saved)

        trip.ride_won(queue, (self.store.reserve_script,), self.took)

    def queue_held(self, pipe: Any) -> None:
        """The reservation alone, then ``WAIT`` where replicas must hold it; read the replies
        with :meth:`took`."""
        self._queue_held(pipe, None)

    def _queue_held(self, pipe: Any, saved: SaveMark | None) -> None:
        if saved is None:
            self.queue(pipe)
        else:
            self.queue_on_save(pipe, saved)
        if self.store.acks.on:
            self.store.acks.queue(pipe)

    def took(self, replies: list[Any]) -> None:
        self.take(replies)
        if self.store.acks.on:
            self.acked = replies[1]

    @property
    def held(self) -> bool:
        """Whether it may be spent on: replicas hold it, or none need to, or nothing was
        granted (nothing to spend)."""
        acks, found = self.store.acks, self.result
        if found is None:  # never answered (its round trip after a won save was lost)
            return False
        if not acks.on or not found.granted:
            return True
        return acks.held(self.acked)

    def take(self, replies: Sequence[Any]) -> Reservation:
        code, value, used, slot = (int(x) for x in replies[0])
        amount = int(self.args[1])
        if code < 0:  # rode in a save that lost: nothing reserved, nothing to submit
            reason = "budget: not reserved (the race save it rode with lost)"
            found = Reservation(self.reservation_id, False, amount, reason=reason, cap="none")
        elif code in (GRANTED, REPEAT):
            found = Reservation(self.reservation_id, True, value, repeat=code == REPEAT)
        elif code == SETTLED:
            reason = "budget: this attempt's reservation was settled already: not submitted again"
            found = Reservation(self.reservation_id, False, amount, reason=reason, cap="settled")
        else:
            cap = self.cap_name(slot)
            reason = refusal_text(cap, value, used, amount)
            found = Reservation(self.reservation_id, False, amount, reason=reason, cap=cap)
        self.result = found
        return found


class BudgetStore:
    """The budget ledger under ``prefix`` (keys from :func:`budget_keys`)."""

    def __init__(
        self,
        client: Any,
        prefix: str = "gpuhedge",
        *,
        keep_s: float = KEEP_S,
        acks: ReplicaAcks | None = None,
    ):
        self.client = client
        self.prefix = prefix
        # replicas that must hold a granted reservation before its job is submitted (0: none)
        self.acks = acks or ReplicaAcks()
        self.keys = budget_keys(prefix)
        self.keep_ms = int(keep_s * 1000)
        self.reserve_script = lua_script(client, "budget_reserve")
        self.settle_script = lua_script(client, "budget_settle")

    # -- reserving ---------------------------------------------------------------------------

    def prepare(
        self,
        race_id: str,
        attempt_id: str,
        *,
        amount_usd: float,
        day: str,
        provider: str,
        key: str | None,
        role: str,
        caps_nano: Sequence[int],
        cap_name: Callable[[int], str],
        open_until_ms: int,
    ) -> PendingReservation:
        """One attempt's reservation, to queue on a pipeline (see :class:`PendingReservation`).

        ``caps_nano``: the per-request cap, then the cap of each scope the reservation charges
        (:func:`~gpuhedge_celery.core.budget.cap_slots`: -1 where none applies).
        """
        rid = reservation_id(race_id, attempt_id)
        k = self.keys
        keys = [k.totals, k.open, k.ledger, k.reservation(rid), k.request(race_id)]
        args: list[Any] = [
            rid,
            to_nano(amount_usd, round_up=True),
            open_until_ms,
            self.keep_ms,
            day,
            provider,
            key or "",
            role,
            *caps_nano,
        ]
        return PendingReservation(self, rid, keys, args, cap_name)

    def reserve(self, pending: PendingReservation) -> Reservation:
        """Run a prepared reservation on its own (one round trip); with replicas to wait for,
        a granted one only once they hold it (:meth:`acknowledged`)."""
        if self.acks.on:
            return self.acknowledged(pending)
        with store_errors("reserving a budget"):
            replies = run_pipeline(self.client, pending.queue, [self.reserve_script])
        return pending.take(replies)

    def acknowledged(self, pending: PendingReservation) -> Reservation:
        """The reservation once the replicas :attr:`acks` asks for hold it: as answered if
        they do already (:attr:`PendingReservation.held`), else sent (again: answered as a
        repeat, or refused now if it was lost and no longer fits) with ``WAIT`` after it
        until they do. Raises :class:`~.replicas.NotAcknowledged` when they never do: nothing
        may be spent on it yet."""
        if pending.result is not None and pending.held:
            return pending.result
        what = f"budget reservation {pending.reservation_id}"

        def send() -> tuple[Reservation, Any]:
            with store_errors("reserving a budget"):
                replies = run_pipeline(self.client, pending.queue_held, [self.reserve_script])
            pending.took(replies)
            found = pending.result
            assert found is not None
            return found, pending.acked if found.granted else None  # a refusal spends nothing

        short = pending.acked if pending.result is not None else None
        return self.acks.until_held(what, "reservation", send, short=short)

    # -- settling ----------------------------------------------------------------------------

    def _settle_call(
        self,
        race_id: str,
        items: Sequence[tuple[str, int, str]],
        now_ms: int,
        only_if: tuple[str, str] | None = None,
    ) -> tuple[list[str], list[Any]]:
        k = self.keys
        keys = [k.totals, k.open, k.ledger, k.request(race_id)]
        args: list[Any] = [self.keep_ms, now_ms, ""]
        if only_if is not None:
            state_key, mark = only_if
            keys.append(state_key)
            args[2] = mark
        for attempt_id, nano, source in items:
            keys.append(k.reservation(reservation_id(race_id, attempt_id)))
            args += [
                min(max(int(nano), 0), MAX_NANO),
                source,
            ]  # the script settles at most the reservation
        return keys, args

    def queue_settle(
        self,
        pipe: Any,
        race_id: str,
        items: Sequence[tuple[str, int, str]],
        now_ms: int,
        *,
        only_if: tuple[str, str] | None = None,
    ) -> None:
        """Queue the settlement of ``items`` (attempt id, cost in nano-dollars, source).

        ``only_if``: the mark of the race save queued before it on ``pipe``
        (:meth:`RaceStore.save_mark <gpuhedge_celery.store.races.RaceStore.save_mark>`): it
        settles only if that save won. The script then reads the race's state hash, a key on
        the race's slot, not ``{budget}``'s (a single primary runs it; docs/costs.md).
        """
        keys, args = self._settle_call(race_id, items, now_ms, only_if)
        queue_script(pipe, self.settle_script, keys, args)

    def settle(
        self, race_id: str, items: Sequence[tuple[str, int, str]], now_ms: int
    ) -> tuple[int, int]:
        """Settle on its own (one round trip); returns (reservations settled now, their nano)."""
        if not items:
            return 0, 0
        with store_errors(f"settling the budget of race {race_id!r}"):
            replies = run_pipeline(
                self.client,
                lambda pipe: self.queue_settle(pipe, race_id, items, now_ms),
                [self.settle_script],
            )
        count, nano = replies[0]
        return int(count), int(nano)

    # -- reading -----------------------------------------------------------------------------

    def totals(self) -> dict[str, int]:
        """Every counter: ``r|<scope>`` reserved and ``s|<scope>`` spent, nano-dollars."""
        with store_errors("reading the budget totals"):
            raw = self.client.hgetall(self.keys.totals)
        return {as_text(k): int(v) for k, v in raw.items()}

    def counters(self, scopes: Iterable[str]) -> dict[str, tuple[int, int]]:
        """``scope -> (reserved, spent)`` nano-dollars for the given scopes (one round trip)."""
        wanted = list(scopes)
        fields = [f"{kind}|{s}" for s in wanted for kind in ("r", "s")]
        if not fields:
            return {}
        with store_errors("reading the budget counters"):
            values = self.client.hmget(self.keys.totals, fields)
        out = {}
        for i, scope in enumerate(wanted):
            out[scope] = (int(values[2 * i] or 0), int(values[2 * i + 1] or 0))
        return out

    def reservation(self, race_id: str, attempt_id: str) -> dict[str, str] | None:
        """One attempt's reservation record (amount, scopes, settled...), None if it has none."""
        key = self.keys.reservation(reservation_id(race_id, attempt_id))
        with store_errors("reading a reservation"):
            raw = self.client.hgetall(key)
        return {as_text(k): as_text(v) for k, v in raw.items()} or None

    def open_due(self, before_ms: int, limit: int = 100) -> list[dict[str, str]]:
        """Open reservations whose open-until time is before ``before_ms`` (their records)."""
        with store_errors("scanning open reservations"):
            ids = self.client.zrangebyscore(self.keys.open, "-inf", before_ms, start=0, num=limit)
            pipe = self.client.pipeline(transaction=False)
            for rid in ids:
                pipe.hgetall(self.keys.reservation(as_text(rid)))
            records = pipe.execute() if ids else []
        out = []
        for rid, raw in zip(ids, records, strict=True):
            record = {as_text(k): as_text(v) for k, v in raw.items()}
            if not record:  # its record expired: nothing to settle; drop it from the index
                self.client.zrem(self.keys.open, rid)
                continue
            out.append({**record, "id": as_text(rid)})
        return out

    def open_count(self) -> int:
        with store_errors("counting open reservations"):
            return int(self.client.zcard(self.keys.open))

    def entries(self, start: str = "-", count: int = 1000) -> Iterator[tuple[str, dict[str, str]]]:
        """The ledger stream from ``start`` (a stream id, inclusive), oldest first."""
        cursor = start
        exclusive = False
        while True:
            lower = f"({cursor}" if exclusive else cursor
            with store_errors("reading the budget ledger"):
                batch = self.client.xrange(self.keys.ledger, min=lower, max="+", count=count)
            for entry_id, data in batch:
                yield as_text(entry_id), {as_text(k): as_text(v) for k, v in data.items()}
            if len(batch) < count:
                return
            cursor, exclusive = as_text(batch[-1][0]), True

    def repair(self, *, apply: bool, attempts: int = 5) -> dict[str, list[int]]:
        """Compare the counters with the ledger stream replayed; with ``apply``, replace them by
        the replayed figures. Returns counter -> [in Redis, from the ledger] where they differed.

        The stream is WATCHed from its first read to the write, so an entry appended meanwhile
        (a race reserving) makes the write fail and the comparison start again."""
        import redis

        from ..core.ledger import counters_from_ledger, differences

        k = self.keys
        for _ in range(attempts):
            with store_errors("repairing the budget counters"), self.client.pipeline() as pipe:
                try:
                    pipe.watch(k.ledger)
                    self._refuse_if_trimmed()
                    expected = counters_from_ledger(fields for _, fields in self.entries())
                    found = {as_text(f): int(v) for f, v in pipe.hgetall(k.totals).items()}
                    diff = differences(found, expected)
                    if apply and diff:
                        pipe.multi()
                        pipe.delete(k.totals)
                        if expected:
                            pipe.hset(k.totals, mapping=expected)
                        pipe.execute()
                    return diff
                except redis.WatchError:
                    continue
        raise StoreError(f"the ledger kept changing through {attempts} tries: run repair again")

    def _refuse_if_trimmed(self) -> None:
        """A ledger that lost its oldest entries (``XTRIM``) no longer adds up to the counters:
        replaying what is left would undercount what was spent and loosen every lifetime cap."""
        try:
            info = self.client.xinfo_stream(self.keys.ledger)
        except Exception as e:  # no stream: nothing was ever reserved, or it was deleted
            if "no such key" not in str(e).lower():
                raise
            if self.client.hlen(self.keys.totals):
                raise StoreError(
                    "the ledger stream is gone but the counters are not: they "
                    "cannot be rebuilt from it"
                ) from None
            return
        added, length = info.get("entries-added"), info.get("length")
        if added is None:
            raise StoreError(
                "this Redis does not say whether the ledger was trimmed (Redis 7 "
                "does): the counters cannot be rebuilt from it safely"
            )
        if int(added) != int(length):
            raise StoreError(
                f"the ledger was trimmed ({length} of {added} entries left): the "
                "counters cannot be rebuilt from it"
            )

    def add_reconciliation(self, fields: dict[str, Any]) -> str:
        """Append one reconciliation record (``costs``: a provider's figure beside ours)."""
        flat = {k: "" if v is None else str(v) for k, v in fields.items()}
        with store_errors("writing a reconciliation record"):
            return as_text(self.client.xadd(self.keys.ledger, {"type": "reconcile", **flat}))


# -- the report of ``gpuhedge-celery budget`` (and the budget gauges of ``metrics serve``) ------


def _row(
    scope: str,
    kind: str,
    name: str,
    what: str,
    cap: float | None,
    counters: dict[str, tuple[int, int]],
) -> dict[str, Any]:
    reserved, spent = counters.get(scope, (0, 0))
    used = reserved + spent
    return {
        "scope": scope,
        "kind": kind,  # day, ceiling, provider_day, provider, key_day, key
        "name": name,  # the provider or key ("" for the day and the ceiling)
        "what": what,
        "cap_usd": cap,
        "reserved_usd": to_usd(reserved),
        "spent_usd": to_usd(spent),
        "headroom_usd": None if cap is None else round(cap - to_usd(used), 9),
    }


def budget_report(
    ledger: BudgetStore,
    caps: BudgetCaps,
    providers: list[str],
    day: str,
    *,
    seen_keys: bool = True,
) -> dict[str, Any]:
    """Caps and counters for ``day``, from one ledger: rows for the day, the ceiling, each
    provider and each budget key (today and lifetime). Keys are those the config names, plus,
    with ``seen_keys``, every key the ledger has counters for (spend recorded before the keys
    were checked against the config, or under an older config)."""
    totals = ledger.totals()
    seen = {k.split("|k:", 1)[1] for k in totals if k.startswith(("r|k:", "s|k:"))}
    keys = sorted(set(caps.keys) | (seen if seen_keys else set()))
    wanted = ["all", f"d:{day}"]
    for p in providers:
        wanted += [f"p:{p}", f"d:{day}:p:{p}"]
    for k in keys:
        wanted += [f"k:{k}", f"d:{day}:k:{k}"]
    counters = {s: (totals.get(f"r|{s}", 0), totals.get(f"s|{s}", 0)) for s in wanted}
    rows = [
        _row(f"d:{day}", "day", "", f"UTC day {day}", caps.max_usd_per_day, counters),
        _row("all", "ceiling", "", "lifetime ceiling", caps.ceiling_usd, counters),
    ]
    for p in providers:
        own = caps.providers.get(p)
        rows.append(
            _row(
                f"d:{day}:p:{p}",
                "provider_day",
                p,
                f"provider {p}, today",
                own.max_usd_per_day if own else None,
                counters,
            )
        )
        rows.append(
            _row(
                f"p:{p}",
                "provider",
                p,
                f"provider {p}, lifetime",
                own.max_usd_total if own else None,
                counters,
            )
        )
    for k in keys:
        own = caps.key_cap(k)
        rows.append(
            _row(
                f"d:{day}:k:{k}",
                "key_day",
                k,
                f"key {k}, today",
                own.max_usd_per_day if own else None,
                counters,
            )
        )
        rows.append(
            _row(
                f"k:{k}",
                "key",
                k,
                f"key {k}, lifetime",
                own.max_usd_total if own else None,
                counters,
            )
        )
    return {
        "enabled": caps.enabled,
        "day": day,
        "max_usd_per_request": caps.max_usd_per_request,
        "default_key": caps.default_key,
        "unknown_keys": caps.unknown_keys,
        "rows": rows,
        "open_reservations": ledger.open_count(),
        # settlements capped at their reservation, per provider (budget_settle.lua counts them)
        "over_reported": {p: totals.get(f"o|{p}", 0) for p in providers},
    }
