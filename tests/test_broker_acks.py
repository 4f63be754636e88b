"""The broker transport's acknowledgements of race tasks ride in the next delivery's round trip.

A real kombu connection through ``gpuhedge_celery.tasks.broker:Transport`` on the real Redis
(its keys under the test's prefix); messages carry the ``task`` header as Celery's do.
"""

from __future__ import annotations

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from gpuhedge_celery.tasks import broker

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


@pytest.fixture
def channel(redis_url, redis_client, prefix):
    options = {"global_keyprefix": f"{prefix}:"}
    with Connection(redis_url, transport=broker.TRANSPORT, transport_options=options) as conn:
        channel = conn.channel()
        channel.unacked_in_redis = lambda: set(redis_client.hkeys(f"{prefix}:unacked"))
        yield conn, channel
        channel.close()


def publish(channel, queue, tasks):
    producer = Producer(channel)
    for i, task in enumerate(tasks):
        producer.publish({"i": i}, exchange=queue.exchange, routing_key=queue.routing_key,
                         headers={"task": task}, declare=[queue])  # fmt: skip


def unacked(channel) -> set[str]:
    return channel.unacked_in_redis()


def one_delivered(conn, ch, name: str, task: str):
    """Publish one ``task`` message on a queue of its own and deliver it; the message."""
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    publish(ch, queue, [task])
    got = []
    Consumer(ch, [queue], callbacks=[lambda body, m: got.append(m)], no_ack=False).consume()
    conn.drain_events(timeout=5)
    return got[-1]


def test_a_race_tasks_ack_waits_for_the_next_delivery_and_others_go_at_once(channel):
    conn, ch = channel
    queue = Queue("t-coord", Exchange("t-coord", type="direct"), routing_key="t-coord")
    publish(ch, queue, ["gpuhedge.hedged_infer", "gpuhedge.race_step", "gpuhedge.pooled_infer"])
    got = []
    consumer = Consumer(ch, [queue], callbacks=[lambda body, m: got.append(m)], no_ack=False)
    consumer.qos(prefetch_count=1)
    consumer.consume()
    conn.drain_events(timeout=5)
    first = got[-1]
    assert unacked(ch) == {first.delivery_tag}
    first.ack()
    assert unacked(ch) == {first.delivery_tag}  # lingering: no round trip of its own
    conn.drain_events(timeout=5)  # the prefetch slot is free: the next message comes
    second = got[-1]
    assert unacked(ch) == {second.delivery_tag}  # the first's ack rode in this delivery
    second.ack()
    conn.drain_events(timeout=5)
    third = got[-1]
    assert unacked(ch) == {third.delivery_tag}
    third.ack()  # not a race task (a pooled GPU job): acknowledged at once
    assert unacked(ch) == set()
    assert [m.payload["i"] for m in got] == [0, 1, 2]


def test_what_no_delivery_took_is_flushed_and_close_flushes(channel):
    conn, ch = channel
    queue = Queue("t-coord2", Exchange("t-coord2", type="direct"), routing_key="t-coord2")
    publish(ch, queue, ["gpuhedge.hedged_infer", "gpuhedge.hedged_infer"])
    got = []
    consumer = Consumer(ch, [queue], callbacks=[lambda body, m: got.append(m)], no_ack=False)
    consumer.consume()
    conn.drain_events(timeout=5)
    got[-1].ack()
    ch.qos.flush_acks()  # what the worker's event loop does every GPUHEDGE_ACK_LINGER_MS
    assert unacked(ch) == set()
    conn.drain_events(timeout=5)
    got[-1].ack()
    assert len(unacked(ch)) == 1
    ch.close()
    assert unacked(ch) == set()  # closing sent the waiting acknowledgement


def test_a_zero_linger_acknowledges_at_once(channel, monkeypatch):
    monkeypatch.setattr(broker, "ack_linger_s", lambda: 0.0)
    conn, ch = channel
    one_delivered(conn, ch, "t-coord3", "gpuhedge.hedged_infer").ack()
    assert unacked(ch) == set()


def test_receipts_that_expire_before_the_visibility_timeout_turn_lingering_off(
    channel, monkeypatch
):
    """A task redelivered after the visibility timeout must find its race's keys: where they
    expire sooner (a short GPUHEDGE_RECEIPT_TTL_S), acknowledgements go at once."""
    monkeypatch.setattr(broker, "_receipt_ttl_s", lambda: 60.0)
    conn, ch = channel
    assert ch.qos.visibility_timeout > 60
    one_delivered(conn, ch, "t-coord4", "gpuhedge.hedged_infer").ack()
    assert unacked(ch) == set()
