"""Redis failovers under the lease and race stores: a primary, two replicas and three Sentinels
on loopback, clients on the ``sentinel://`` URL, and at least 50 failovers forced at the worst
moments.

Most rounds are *lossy*: the replicas are cut off, then a GPU is claimed (and its job accepted
by the GPU's worker) and a race's winner is claimed on the old primary alone, then Sentinel
promotes a replica that never saw those writes. Other rounds fail over while threads keep
claiming leases and winners (a claim in flight when the primary changes). Counted against what
each client was told, never against what Redis says after the fact:

* double winners: two attempts of one race both told "you won, acknowledged";
* tokens issued twice or going back: per GPU, every token a claim returned, in order;
* stale renewals or releases accepted: the holder of a lease lost in the failover renewing or
  releasing after another holder got the GPU;
* a GPU worker accepting an older token after a newer one.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import defaultdict

import pytest
import redis

from gpuhedge_celery.core.lease_rules import GpuInfo
from gpuhedge_celery.errors import LeaseLost, StaleToken, StoreUnavailable
from gpuhedge_celery.redis_url import with_sentinel_options
from gpuhedge_celery.store.connection import redis_from_url, replication_warning
from gpuhedge_celery.store.leases import LeaseStore
from gpuhedge_celery.store.races import RaceStore
from gpuhedge_celery.store.replicas import NotAcknowledged, ReplicaAcks
from tests.support.sentinel import SentinelGroup

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FAILOVERS = 50
GPUS = ("fo-host:0", "fo-host:1")
LOADED_GPU = "fo-host:2"  # the loaded rounds' own: a release lost there cannot block a lossy round
TRANSIENT = (StoreUnavailable, redis.RedisError, ConnectionError, OSError)


def eventually(call, timeout_s: float = 20.0, *, unacknowledged_is_final: bool = False):
    """``call()`` once the group answers: failovers make the first tries fail (connections
    killed, the old primary read-only, replicas resyncing before a WAIT can count them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except NotAcknowledged:
            if unacknowledged_is_final or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        except TRANSIENT:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Tally:
    """What clients were told, and the violations found in it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.tokens: dict[str, list[int]] = defaultdict(list)  # per GPU, in issue order
        self.winners: dict[str, set[str]] = defaultdict(set)  # per race: attempts told "won"
        self.stale_accepted: list[str] = []
        self.worker_went_back: list[str] = []
        self.failovers = {"lossy": 0, "under_load": 0}
        self.lost_claims = 0  # lossy rounds whose first winner claim was never acknowledged
        self.unexpected: list[str] = []  # errors a failover must not cause (a failed command)

    def issued(self, gpu: str, token: int) -> None:
        with self.lock:
            self.tokens[gpu].append(token)

    def won(self, race: str, attempt: str) -> None:
        with self.lock:
            self.winners[race].add(attempt)

    def summary(self) -> dict:
        reused_or_back = sum(
            1 for seq in self.tokens.values() for a, b in zip(seq, seq[1:], strict=False) if b <= a
        )
        return {
            "failovers": self.failovers,
            "tokens_issued": sum(len(s) for s in self.tokens.values()),
            "tokens_reused_or_back": reused_or_back,
            "races_claimed": len(self.winners),
            "double_winners": sum(1 for w in self.winners.values() if len(w) > 1),
            "stale_renew_or_release_accepted": len(self.stale_accepted),
            "worker_accepted_older_token": len(self.worker_went_back),
            "unacknowledged_first_claims": self.lost_claims,
        }


@pytest.fixture(scope="module")
def group():
    with SentinelGroup() as g:
        yield g


def url_of(group) -> str:
    """The group's URL as a deployment writes it, the Sentinels' own password included."""
    return with_sentinel_options(group.url, group.master_name, group.sentinel_password)


def stores(url: str, prefix: str):
    client = redis_from_url(url, decode_responses=True, socket_timeout=2)
    leases = LeaseStore(client, prefix)
    # every replica: one still following the old primary while Sentinel promotes another
    # could acknowledge a claim the new primary never gets (replication_warning)
    races = RaceStore(client, prefix, acks=ReplicaAcks(replicas=2, timeout_ms=200))
    return leases, races


def lossy_round(group, leases, worker, races, tally: Tally, n: int) -> None:
    """Claim a GPU, start its job, claim a race's winner, all on the old primary alone; fail
    over; then a second holder and a second attempt must not be fooled by what was lost."""
    gpu, race = GPUS[n % 2], f"race-{n}"
    lost: dict = {}

    def on_old_primary(_client) -> None:
        # through the stores' own Sentinel clients (a pooled connection may still point at the
        # primary before last: it fails once and reconnects to this one)
        lost["lease"] = eventually(lambda: leases.try_claim(gpu, f"x{n}", ttl_ms=60_000))
        assert lost["lease"] is not None, "the GPU was left held by an earlier round"
        tally.issued(gpu, lost["lease"].token)
        eventually(lambda: worker.check_fence(gpu, lost["lease"].token, delivery=f"x{n}"))
        try:
            claim = eventually(lambda: races.claim_winner(race, "a1"), unacknowledged_is_final=True)
        except NotAcknowledged:  # the replicas are cut off: never counted, never published
            tally.lost_claims += 1
        else:
            if claim.won:
                tally.won(race, "a1")

    group.lossy_failover(on_old_primary)
    tally.failovers["lossy"] += 1
    old = lost["lease"]

    new = eventually(lambda: leases.try_claim(gpu, f"y{n}", ttl_ms=60_000))
    assert new is not None, f"round {n}: the GPU lost with its lease is not free again"
    tally.issued(gpu, new.token)
    # the GPU worker still remembers the lost job's token: the new one must pass its gate
    try:
        eventually(lambda: worker.check_fence(gpu, new.token, delivery=f"y{n}"))
    except StaleToken:
        tally.worker_went_back.append(f"round {n}: {new.token} after {old.token}")
    for name, stale in (("renew", leases.renew), ("release", leases.release)):
        try:
            eventually(lambda stale=stale: stale(old))
        except (LeaseLost, StaleToken):
            pass
        else:
            tally.stale_accepted.append(f"round {n}: {name} of {old.token} by x{n}")
    claim = eventually(lambda: races.claim_winner(race, "a2"))
    if claim.won:
        tally.won(race, "a2")
    eventually(lambda: leases.release(new))


def loaded_round(group, url: str, prefix: str, tally: Tally, n: int) -> None:
    """A failover while threads claim winners of fresh races and cycle leases: claims in flight
    when the primary changes."""
    stop = threading.Event()
    gpu = LOADED_GPU

    def claim_races(who: str) -> None:
        _, races = stores(url, prefix)
        k = 0
        while not stop.is_set():
            k += 1
            race = f"load-{n}-{k // 2}"  # two claimers per race id: one must lose
            try:
                claim = races.claim_winner(race, f"{who}-{k}")
            except TRANSIENT:
                time.sleep(0.02)
                continue
            if claim.won:
                tally.won(race, f"{who}-{k}")

    def cycle_leases() -> None:
        leases, _ = stores(url, prefix)
        held = None
        while not stop.is_set():
            try:
                if held is None:
                    held = leases.try_claim(gpu, f"c{n}", ttl_ms=3_000)
                    if held is not None:
                        tally.issued(gpu, held.token)
                else:
                    leases.renew(held)
                    leases.release(held)
                    held = None
            except (LeaseLost, StaleToken):
                held = None
            except TRANSIENT:
                time.sleep(0.02)
        if held is not None:
            try:
                eventually(lambda: leases.release(held))
            except (LeaseLost, StaleToken):
                pass

    def recorded(target, *args) -> None:
        try:
            target(*args)
        except Exception as e:  # a failover is an outage to retry: anything else is a finding
            tally.unexpected.append(repr(e))

    threads = [threading.Thread(target=recorded, args=(claim_races, w)) for w in ("p", "q")]
    threads.append(threading.Thread(target=recorded, args=(cycle_leases,)))
    for t in threads:
        t.start()
    try:
        time.sleep(0.2)
        group.failover()
        tally.failovers["under_load"] += 1
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(30)


def test_fifty_failovers_leave_one_winner_per_race_and_tokens_that_only_grow(group):
    prefix = f"fo{uuid.uuid4().hex[:8]}"
    url = url_of(group)
    leases, races = stores(url, prefix)
    worker, _ = stores(url, prefix)  # the GPU worker's own process: its own fence mark
    for gpu in (*GPUS, LOADED_GPU):
        eventually(lambda gpu=gpu: leases.register_gpu(GpuInfo(gpu, "default", "fo-host")))
    tally = Tally()
    started = time.monotonic()
    for n in range(FAILOVERS):
        if n % 5 == 4:
            loaded_round(group, url, prefix, tally, n)
        else:
            lossy_round(group, leases, worker, races, tally, n)
    summary = {**tally.summary(), "seconds": round(time.monotonic() - started, 1)}
    print(json.dumps(summary))
    assert sum(tally.failovers.values()) >= FAILOVERS
    # the lossy rounds really lost their writes: no first claim was ever acknowledged
    assert tally.lost_claims == tally.failovers["lossy"]
    assert summary["double_winners"] == 0, dict(tally.winners)
    assert summary["tokens_reused_or_back"] == 0, dict(tally.tokens)
    assert tally.stale_accepted == []
    assert tally.worker_went_back == []
    assert tally.unexpected == []
    assert summary["races_claimed"] >= tally.failovers["lossy"]


def test_workers_warn_when_a_winner_waits_for_fewer_replicas_than_the_primary_has(group):
    client = redis_from_url(url_of(group), decode_responses=True)
    warning = eventually(lambda: replication_warning(client, 1))
    assert "2 replicas" in warning and "set it to 2" in warning and "\n" not in warning
    assert replication_warning(client, 2) is None
