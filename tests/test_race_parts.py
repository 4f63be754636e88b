"""A race's state saved in parts: a save sends only what changed, and never applies a delta to
a state other than its base (real redis-server)."""

from __future__ import annotations

import pytest
import redis.connection

from gpuhedge_celery.store import race_parts
from gpuhedge_celery.store.race_keys import RaceShards
from gpuhedge_celery.store.races import RaceStore, VersionConflict

pytestmark = [pytest.mark.timeout(60), pytest.mark.cluster]


def race_state(attempts: int, results: dict | None = None) -> dict:
    """A state shaped as the driver saves it (a race with attempts, results, a spec)."""
    return {
        "race": {
            "race_id": "r1",
            "policy": {"name": "fixed", "hedge_after_ms": 10000},
            "attempts": [
                {"id": f"a{i}", "phase": "running", "timeline": [[0.5 * i, "launched"]]}
                for i in range(attempts)
            ],
            "timers": {"hedge": 10.0},
            "finished": False,
        },
        "spec": {"validator": "wav", "caps_s": {"p": 120.0, "h": 120.0}, "pad": "x" * 800},
        "timer_ids": {"hedge": "r1|hedge|10000|1"},
        "results": dict(results or {}),
        "caller": {"reply_to": "q"},
    }


class SentBytes:
    """Counts the bytes every redis-py connection sends (what Redis receives), a plain
    server's or a cluster node's alike."""

    def __init__(self, monkeypatch):
        self.sent = 0
        send = redis.connection.Connection.send_packed_command

        def counted(conn, command, check_health=True):
            chunks = [command] if isinstance(command, (bytes, str)) else command
            self.sent += sum(len(c) for c in chunks)
            return send(conn, command, check_health)

        monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counted)


@pytest.fixture
def counted(redis_client, monkeypatch):
    """The store's client, and what it sends (:class:`SentBytes`)."""
    return redis_client, SentBytes(monkeypatch)


@pytest.mark.parametrize(
    "state",
    [
        race_state(0),
        race_state(2, {"a1": {"ok": True}, "a:2 x": {"ok": False}}),
        {"anything": [1, 2], "results": ["not", "a", "dict"]},
        {"race": {"attempts": "not a list"}, "n": 1},
        {"race": {"attempts": [{"id": "a1"}], "~attempts": 7}},  # our marker's name: kept whole
        {"race": {"~attempts": 2}, "results": {"~keys": ["x"]}},
        {"results": {"a1": 1, "a:2 x|y": 2, "": 3}},
        {"race": {"attempts": []}, "results": {}},
        {},
    ],
)
def test_parts_give_back_the_state_they_were_made_from(state):
    encoded = race_parts.encode(state, "state")
    assert race_parts.decode(encoded.parts) == state


def test_results_with_keys_other_than_strings_read_back_as_json_has_them():
    state = {"results": {1: "one", "a1": "x"}}
    assert race_parts.decode(race_parts.encode(state, "s").parts) == {
        "results": {"1": "one", "a1": "x"}
    }


def test_a_state_of_thousands_of_parts_is_saved_and_shrunk(redis_client, prefix):
    """Redis's Lua stack holds about 8,000 values: the script sets and deletes in chunks."""
    races = RaceStore(redis_client, prefix)
    many = race_state(1, {f"a{i}": i for i in range(5000)})
    races.create("r1", many)
    assert RaceStore(redis_client, prefix).load("r1").state == many
    few = race_state(1, {"a1": 1})
    assert RaceStore(redis_client, prefix).save("r1", few, 1) == 2  # a full write drops 4,999
    assert races.load("r1").state == few
    assert races.save("r1", many, 2) == 3  # a delta of 4,999 parts
    assert races.save("r1", few, 3) == 4  # a delta deleting them
    assert RaceStore(redis_client, prefix).load("r1").state == few
    assert len(redis_client.hkeys(RaceShards(prefix).race("r1").state)) < 20


def test_a_state_that_is_not_json_is_named_in_the_error():
    with pytest.raises(ValueError, match="state of race 'r9' is not JSON-serialisable"):
        race_parts.encode(race_state(1, {"a0": {1, 2}}), "state of race 'r9'")
    with pytest.raises(ValueError, match="state of race 'r9' must be a dict"):
        race_parts.encode([1], "state of race 'r9'")  # type: ignore[arg-type]


def test_a_step_that_changes_one_attempt_sends_that_attempt_not_the_state(counted, prefix):
    client, sent_bytes = counted
    races = RaceStore(client, prefix)
    first = race_state(2)
    races.create("r1", first)
    whole = sum(len(v) for v in race_parts.encode(first, "s").parts.values())
    second = race_state(2)
    second["race"]["attempts"][1]["phase"] = "ended"
    before = sent_bytes.sent
    races.save("r1", second, 1)
    sent = sent_bytes.sent - before
    parts = race_parts.encode(second, "s").parts
    assert sent < whole, (sent, whole)  # not the whole state again
    assert sent < len(parts["p:a:1"]) + 600  # the attempt, and the save's arguments, heartbeat
    assert len(parts["p:t:spec"]) > 800  # (the spec it did not resend)
    assert races.load("r1").state == second
    assert RaceStore(client, prefix).load("r1").state == second  # another process reads it


def test_results_and_attempts_that_leave_the_state_leave_redis(redis_client, prefix):
    races = RaceStore(redis_client, prefix)
    races.create("r1", race_state(3, {"a0": {"ok": True}, "a1": {"ok": False}}))
    races.save("r1", race_state(1, {"a1": {"ok": False}}), 1)
    fields = redis_client.hgetall(RaceShards(prefix).race("r1").state)
    assert sorted(f for f in fields if f.startswith("p:a:") or f.startswith("p:x:")) == [
        "p:a:0",
        "p:x:a1",
    ]
    assert races.load("r1").state == race_state(1, {"a1": {"ok": False}})


def test_a_delta_is_never_applied_to_another_state_of_the_same_version(redis_client, prefix):
    """The race was deleted and created again (version 1 again) by another process since this
    one saved version 1: this one's delta from its copy is refused, and after reading the
    race again its save holds."""
    mine, other = RaceStore(redis_client, prefix), RaceStore(redis_client, prefix)
    mine.create("r1", race_state(2))
    other.delete("r1")
    theirs = race_state(1, {"a0": {"ok": True}})
    other.create("r1", theirs)
    changed = race_state(2)
    changed["caller"] = {"reply_to": "mine"}
    with pytest.raises(VersionConflict):
        mine.save("r1", changed, 1)
    assert other.load("r1").state == theirs  # nothing of the refused delta got in
    record = mine.load("r1")
    assert record.state == theirs
    theirs["caller"] = {"reply_to": "mine"}
    assert mine.save("r1", theirs, record.version) == 2
    assert other.load("r1").state == theirs


def test_a_save_without_a_copy_writes_every_part_and_drops_the_rest(redis_client, prefix):
    RaceStore(redis_client, prefix).create("r1", race_state(3, {"a0": {"ok": True}}))
    fresh = RaceStore(redis_client, prefix)  # never read it: no base, a full write
    assert fresh.save("r1", race_state(1), 1) == 2
    assert RaceStore(redis_client, prefix).load("r1").state == race_state(1)
    fields = redis_client.hgetall(RaceShards(prefix).race("r1").state)
    assert not [f for f in fields if f.startswith(("p:a:1", "p:a:2", "p:x:"))]


def test_a_save_from_a_copy_read_from_redis_sends_a_delta(counted, prefix):
    client, sent_bytes = counted
    RaceStore(client, prefix).create("r1", race_state(2))
    reader = RaceStore(client, prefix)
    record = reader.load("r1")
    record.state["race"]["finished"] = True
    before = sent_bytes.sent
    reader.save("r1", record.state, record.version)
    race = len(race_parts.encode(record.state, "s").parts["p:s:race"])
    assert sent_bytes.sent - before < race + 400  # the race's part only
    assert RaceStore(client, prefix).load("r1").state == record.state


def test_a_state_saved_whole_by_an_older_version_is_read_and_replaced(redis_client, prefix):
    key = RaceShards(prefix).race("r1").state
    old = race_state(1)
    redis_client.hset(key, mapping={"v": 4, "s": "4:abc", "data": race_parts.codec.dumps(old)})
    races = RaceStore(redis_client, prefix)
    record = races.load("r1")
    assert (record.version, record.state) == (4, old)
    old["race"]["finished"] = True
    assert races.save("r1", old, 4) == 5
    assert "data" not in redis_client.hgetall(key)
    assert RaceStore(redis_client, prefix).load("r1").state == old


def test_a_delta_sent_again_after_its_answer_was_lost_is_answered_saved(redis_client, prefix):
    races = RaceStore(redis_client, prefix)
    races.create("r1", race_state(1))
    state = race_state(2)
    encoded = races.encode("r1", state)
    for _ in range(2):  # the second send: the same save id, its first answer lost
        pipe = redis_client.pipeline(transaction=False)
        races.queue_save(pipe, "r1", encoded, 1, "same-id")
        reply = pipe.execute()[0]
    assert races.saved("r1", reply, encoded, 1, "same-id") == 2
    assert RaceStore(redis_client, prefix).load("r1").state == state


def test_an_empty_state_is_a_state(redis_client, prefix):
    RaceStore(redis_client, prefix).create("r0", {})
    record = RaceStore(redis_client, prefix).load("r0")
    assert (record.version, record.state) == (1, {})


def test_a_whole_state_an_older_version_saved_over_the_parts_is_the_one_read(redis_client, prefix):
    """During a rolling upgrade an older worker saves the whole state (``data``) and leaves the
    parts: its state is the current one, and the next save here replaces both."""
    key = RaceShards(prefix).race("r1").state
    mine = RaceStore(redis_client, prefix)
    mine.create("r1", race_state(1))
    create_id = redis_client.hget(key, "s").split(":")[1]
    theirs = race_state(2)
    redis_client.hset(key, mapping={"v": 2, "s": f"2:old 1:{create_id}",
                                    "data": race_parts.codec.dumps(theirs)})  # fmt: skip
    with pytest.raises(VersionConflict):
        mine.save("r1", race_state(3), 1)
    record = mine.load("r1")
    assert (record.version, record.state) == (2, theirs)
    theirs["caller"] = {"reply_to": "new"}
    assert mine.save("r1", theirs, 2) == 3  # a full write: no delta from a whole state
    fields = redis_client.hgetall(key)
    assert "data" not in fields
    assert RaceStore(redis_client, prefix).load("r1").state == theirs
