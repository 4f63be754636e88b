"""Durable timers on a real redis-server: claim order, cancel, leases, redelivery, bad input."""

from __future__ import annotations

import pytest

from gpuhedge_celery.store.timers import (
    ACKED,
    CLAIMED_ELSEWHERE,
    HEAD,
    IF_IDLE,
    NOT_IN_FLIGHT,
    TimerStore,
)

pytestmark = pytest.mark.cluster

T0 = 1_800_000_000_000  # a fixed "now" (epoch ms): the store takes time as an argument


@pytest.fixture
def timers(redis_client, prefix):
    return TimerStore(redis_client, prefix)


def test_claim_returns_due_timers_earliest_first_and_leaves_the_rest(timers):
    dues = [T0 + 30, T0 - 20, T0 + 5000, T0, T0 - 100, T0 + 10]
    ids = {timers.arm(f"race{i}|hedge", due, {"i": i}): due for i, due in enumerate(dues)}
    assert len(ids) == len(dues)

    claim = timers.claim(T0 + 30, limit=100, lease_ms=1000)
    got = [t.due_ms for t in claim.timers]
    assert got == sorted(d for d in dues if d <= T0 + 30)
    assert [t.payload["i"] for t in claim.timers] == [4, 1, 3, 5, 0]
    assert all(t.deliveries == 1 and t.lease_deadline_ms == T0 + 1030 for t in claim.timers)
    assert all(t.key.endswith("|hedge") and t.id.startswith(t.key + "|") for t in claim.timers)
    # What comes next is the claim's own lease deadline, which is earlier than the far timer.
    assert claim.next_ms == T0 + 1030
    assert timers.pending() == 1 and timers.in_flight() == 5
    # Nothing more is due at the same instant: claimed timers are not handed out twice.
    assert timers.claim_due(T0 + 30, limit=100, lease_ms=1000) == []


def test_claim_honours_limit(timers):
    for i in range(7):
        timers.arm(f"r|t{i}", T0 - 7 + i, {})
    first = timers.claim_due(T0, limit=3, lease_ms=1000)
    second = timers.claim_due(T0, limit=3, lease_ms=1000)
    third = timers.claim_due(T0, limit=3, lease_ms=1000)
    assert [len(first), len(second), len(third)] == [3, 3, 1]
    assert [t.due_ms for t in first + second + third] == [T0 - 7 + i for i in range(7)]


def test_ack_removes_the_timer_for_good(timers, redis_client):
    timers.arm("r|hedge", T0, {"x": 1})
    (timer,) = timers.claim_due(T0, 10, 1000)
    assert timers.ack(timer) is True
    assert timers.ack_many([timer]) == [NOT_IN_FLIGHT]
    assert timers.claim_due(T0 + 10_000, 10, 1000) == []
    assert timers.pending() == 0 and timers.in_flight() == 0
    assert redis_client.hlen(timers.keys.data) == 0
    assert redis_client.hlen(timers.keys.deliveries) == 0


def test_cancel_waiting_and_in_flight_timers(timers):
    waiting = timers.arm("r|safety", T0 + 100, {})
    flying = timers.arm("r|hedge", T0, {})
    (claimed,) = timers.claim_due(T0, 10, 1000)
    assert claimed.id == flying
    assert timers.cancel(waiting) is True
    assert timers.cancel(flying) is True
    assert timers.cancel(flying) is False
    assert timers.cancel("never|armed|1") is False
    # The cancelled in-flight timer is neither acknowledged nor redelivered.
    assert timers.ack(claimed) is False
    assert timers.claim_due(T0 + 60_000, 10, 1000) == []


def test_lapsed_claim_is_redelivered_and_only_the_new_claim_can_ack(timers):
    timer_id = timers.arm("r|cutover", T0, {"n": 1})
    (first,) = timers.claim_due(T0, 10, lease_ms=1000)
    assert timers.claim_due(T0 + 999, 10, 1000) == []  # lease still running
    (second,) = timers.claim_due(T0 + 1000, 10, lease_ms=1000)
    assert second.id == timer_id and second.due_ms == T0
    assert (first.deliveries, second.deliveries) == (1, 2)
    assert timers.ack_many([first]) == [CLAIMED_ELSEWHERE]
    assert timers.ack_many([second]) == [ACKED]
    assert timers.claim_due(T0 + 100_000, 10, 1000) == []


def test_redelivered_timers_come_before_newer_due_ones(timers):
    old = timers.arm("r|old", T0, {})
    timers.claim_due(T0, 10, lease_ms=100)
    for i in range(5):
        timers.arm(f"r|new{i}", T0 + 50 + i, {})
    claimed = timers.claim_due(T0 + 200, limit=2, lease_ms=100)
    assert claimed[0].id == old and claimed[0].deliveries == 2
    assert claimed[1].due_ms == T0 + 50


def test_explicit_timer_id_makes_arming_idempotent(timers):
    assert timers.arm("r|hedge", T0, {"a": 1}, timer_id="r|hedge|v3") == "r|hedge|v3"
    assert timers.arm("r|hedge", T0 - 50, {"a": 2}, timer_id="r|hedge|v3") == "r|hedge|v3"
    assert timers.due_time("r|hedge|v3") == T0
    (timer,) = timers.claim_due(T0, 10, 1000)
    # Still in flight: a redelivered task arming it again changes nothing.
    timers.arm("r|hedge", T0, {"a": 3}, timer_id="r|hedge|v3")
    assert timers.pending() == 0 and timer.payload == {"a": 1}
    timers.ack(timer)


def test_arm_many_arms_in_one_round_trip(timers):
    ids = timers.arm_many([(f"r{i}|hedge", T0 + i, {"i": i}) for i in range(50)])
    assert len(set(ids)) == 50
    claimed = timers.claim_due(T0 + 49, 100, 1000)
    assert [t.payload["i"] for t in claimed] == list(range(50))


def test_earlier_timer_is_announced_on_the_wake_channel(timers, redis_client):
    pubsub = redis_client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(timers.keys.channel)
    try:
        assert pubsub.get_message(timeout=1) is None  # the subscribe confirmation is ignored
        timers.arm("r|late", T0 + 1000, {})
        timers.arm("r|later", T0 + 2000, {})  # not the earliest: no message
        timers.arm("r|early", T0 + 10, {})
        got = []
        while (message := pubsub.get_message(timeout=0.5)) is not None:
            got.append(int(message["data"]))
        assert got == [T0 + 1000, T0 + 10]
    finally:
        pubsub.close()


@pytest.mark.parametrize(
    ("key", "due", "payload", "match"),
    [
        ("", T0, {}, "timer key"),
        ("a\nb", T0, {}, "timer key"),
        ("r|h", -1, {}, "due time"),
        ("r|h", 1.5, {}, "due time"),
        ("r|h", T0, [], "payload"),
        ("r|h", T0, {"x": object()}, "JSON"),
    ],
)
def test_bad_input_is_a_one_line_error_naming_it(timers, key, due, payload, match):
    with pytest.raises(ValueError, match=match) as info:
        timers.arm(key, due, payload)
    assert "\n" not in str(info.value)
    assert timers.pending() == 0


def test_bad_namespace_is_rejected(redis_client, prefix):
    with pytest.raises(ValueError, match="timer namespace"):
        TimerStore(redis_client, prefix, namespace="a{b}")


def test_keys_of_a_namespace_share_one_cluster_slot(timers):
    k = timers.keys
    keys = (k.due, k.inflight, k.data, k.deliveries, k.seq, k.chains)
    tags = {key[key.index("{") : key.index("}") + 1] for key in keys}
    assert tags == {"{timers}"}


def test_a_claim_with_look_ahead_takes_timers_due_within_it(timers, redis_client):
    for i, due in enumerate([T0 - 5, T0 + 10, T0 + 20, T0 + 21, T0 + 500]):
        timers.arm(f"r{i}|t", due, {})
    claim = timers.claim(T0, limit=100, lease_ms=1000, ahead_ms=20)
    assert [t.due_ms for t in claim.timers] == [T0 - 5, T0 + 10, T0 + 20]
    assert claim.next_ms == T0 + 21 and timers.pending() == 2


def test_released_timers_wait_again_at_their_due_time_uncounted(timers, redis_client):
    timers.arm("r|early", T0 + 15, {"x": 1})
    (held,) = timers.claim(T0, limit=10, lease_ms=1000, ahead_ms=20).timers
    assert timers.release([held]) == 1
    assert timers.pending() == 1 and timers.in_flight() == 0
    assert timers.claim(T0, limit=10, lease_ms=1000).timers == []  # not due yet: no early fire
    (again,) = timers.claim(T0 + 15, limit=10, lease_ms=1000).timers
    assert again.id == held.id and again.deliveries == 1  # the released claim does not count
    assert timers.release([held]) == 0  # a stale claim gives nothing back
    assert timers.in_flight() == 1


def _chain_poll(timers, due, chain):
    """Arm the poll of job ``r:w:a1`` due at ``due`` (a chain's id names its due ms)."""
    return timers.arm("r:w:a1", due, {"kind": "watch"}, timer_id=f"r:w:a1|{due}", chain=chain)


def test_a_chain_with_a_timer_waiting_or_in_flight_is_not_armed_again_if_idle(timers):
    assert _chain_poll(timers, T0 + 10, HEAD) == f"r:w:a1|{T0 + 10}"
    # waiting: a recovery's poll is not armed beside it, and is told the live one's id
    assert _chain_poll(timers, T0, IF_IDLE) == f"r:w:a1|{T0 + 10}"
    assert timers.pending() == 1
    (fired,) = timers.claim_due(T0 + 10, 10, 1000)
    # in flight (its handler may be arming the next poll right now): still alive
    assert _chain_poll(timers, T0 + 20, IF_IDLE) == fired.id
    assert timers.pending() == 0 and timers.in_flight() == 1
    # the handler armed the next poll, then was acknowledged: the chain lives on in that poll
    _chain_poll(timers, T0 + 500, HEAD)
    assert timers.ack(fired)
    assert _chain_poll(timers, T0 + 30, IF_IDLE) == f"r:w:a1|{T0 + 500}"
    assert timers.pending() == 1


def test_a_chain_whose_last_timer_was_acknowledged_or_cancelled_is_armed_if_idle(
    timers, redis_client
):
    _chain_poll(timers, T0, HEAD)
    (fired,) = timers.claim_due(T0, 10, 1000)
    assert timers.ack(fired)  # the job ended: its last poll armed no other
    assert redis_client.hlen(timers.keys.chains) == 0  # nothing left behind
    assert _chain_poll(timers, T0 + 5, IF_IDLE) == f"r:w:a1|{T0 + 5}"
    assert timers.pending() == 1
    assert timers.cancel(f"r:w:a1|{T0 + 5}")
    assert redis_client.hlen(timers.keys.chains) == 0
    assert _chain_poll(timers, T0 + 6, IF_IDLE) == f"r:w:a1|{T0 + 6}"
    # a chain head whose timer is gone some other way (an orphan dropped by a claim) is idle
    redis_client.zrem(timers.keys.due, f"r:w:a1|{T0 + 6}")
    assert _chain_poll(timers, T0 + 7, IF_IDLE) == f"r:w:a1|{T0 + 7}"


def test_acknowledging_an_older_timer_of_a_chain_keeps_its_head(timers, redis_client):
    _chain_poll(timers, T0, HEAD)
    (old,) = timers.claim_due(T0, 10, 1000)
    _chain_poll(timers, T0 + 100, HEAD)  # armed by the old poll's handler
    assert timers.ack(old)
    assert redis_client.hget(timers.keys.chains, "r:w:a1") == f"r:w:a1|{T0 + 100}"
    # timers outside chains, even with ids that look alike, never touch a chain's head
    timers.arm("r:w:a1|x", T0, {}, timer_id=f"r:w:a1|{T0 + 100}|7")
    (other,) = timers.claim_due(T0, 10, 1000)
    assert timers.ack(other)
    assert redis_client.hget(timers.keys.chains, "r:w:a1") == f"r:w:a1|{T0 + 100}"


def test_a_chained_timer_needs_an_id_naming_its_key_and_a_known_mode(timers):
    with pytest.raises(ValueError, match="must start with 'r:w:a1|'"):
        timers.arm("r:w:a1", T0, {}, timer_id="other|1", chain=HEAD)
    with pytest.raises(ValueError, match="must start with"):
        timers.arm("r:w:a1", T0, {}, chain=IF_IDLE)  # a numbered id is not the chain's
    with pytest.raises(ValueError, match="invalid chain mode 'tail'"):
        timers.arm("r:w:a1", T0, {}, timer_id="r:w:a1|1", chain="tail")
