"""Race records: built from a finished race, appended in its final round trip, capped, exported.

The driver runs on a real redis-server without Celery (effects recorded, as in
``test_races_driver``); the end-to-end test with real workers is ``test_records_e2e``.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gpuhedge_celery import settings
from gpuhedge_celery.cli import cli
from gpuhedge_celery.commands.records import BadInput, parse_time
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.race.settings import RaceSettings
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.store.races import Keeping, RaceStore
from gpuhedge_celery.store.records import RecordStream
from tests.test_races_driver import FAST, Recorder, build_driver

pytestmark = [pytest.mark.timeout(60), pytest.mark.cluster]


def _named(command: tuple) -> str:
    name = str(command[0])
    return f"{name} {command[1]}" if name == "EVALSHA" else name


class CountingClient:
    """A redis-py client that counts round trips: each direct command and each pipeline run,
    and the commands each pipeline carried (a script as ``EVALSHA <sha>``)."""

    def __init__(self, client):
        self._client = client
        self.round_trips = 0
        self.pipelined: list[list[str]] = []

    def pipeline(self, *args, **kwargs):
        pipe = self._client.pipeline(*args, **kwargs)
        execute = pipe.execute

        def counted(*a, **k):
            self.round_trips += 1
            self.pipelined.append([_named(c[0]) for c in pipe.command_stack])
            return execute(*a, **k)

        pipe.execute = counted
        return pipe

    def register_script(self, source):
        return self._client.register_script(source)

    def __getattr__(self, name):
        found = getattr(self._client, name)
        if not callable(found):
            return found

        def call(*args, **kwargs):
            self.round_trips += 1
            return found(*args, **kwargs)

        return call


def finish_fast_race(redis_client, prefix, race_id, records_maxlen=100_000):
    """Run one zero-latency race to its end; return the driver's store and the counter."""
    counting = CountingClient(redis_client)
    driver, effects, cfg, _, _ = build_driver(counting, prefix, Recorder())
    keeping = Keeping(records_maxlen=records_maxlen)
    driver.store = RaceStore(counting, driver.store.shards, keeping)
    driver.create(race_id, FAST, build_spec(cfg))
    counting.round_trips, counting.pipelined = 0, []
    driver.submit_attempt(race_id, "a1")  # submits, polls: terminal, concluded, finished inline
    assert [r["winner"] for r in effects.results] == ["p"]
    return driver.store, counting, effects


def test_a_finished_race_appends_one_record_matching_its_receipt_and_result(redis_client, prefix):
    store, _, effects = finish_fast_race(redis_client, prefix, "r1")
    entries = list(store.records.read())
    assert len(entries) == 1
    record = entries[0][1]
    receipt = store.receipt("r1")
    result = effects.results[0]
    assert record["v"] == 1 and record["kind"] == "race" and record["race_id"] == "r1"
    assert record["policy"] == result["policy"] and record["providers"] == ["p", "h"]
    assert record["winner"] == "p" and record["e2e_ms"] == round(result["e2e_ms"], 1)
    assert record["ts"] == round(receipt["finished_at"], 3)
    assert not record["hedged"] and not record["cut_over"] and not record["escalated"]
    assert record["leaked"] is False and record["cancels"] == []
    assert record["usd"] == round(receipt["active_usd"], 6)
    won = receipt["attempts"][0]  # priced from the provider's own figure, not our clock
    assert won["cost_source"] == "provider" and won["usd"] == won["metrics"]["cost_usd"]
    attempts_usd = sum(a["usd"] for a in record["attempts"])
    assert attempts_usd == pytest.approx(receipt["active_usd"], abs=1e-6)  # to the micro-dollar
    assert [a["state"] for a in record["attempts"]] == ["COMPLETED"]
    assert record["budget_key"] is None and record["arm"] is None
    assert 0 < record["winner_ms"] <= record["e2e_ms"]


def test_records_cost_no_round_trip_or_command_of_their_own_and_none_when_off(redis_client, prefix):
    store, on, _ = finish_fast_race(redis_client, prefix, "on")
    _, off, _ = finish_fast_race(redis_client, prefix + "x", "off", records_maxlen=0)
    try:
        assert on.round_trips == off.round_trips  # no round trip of its own
        # the record is an argument of the finish, which rides in the finishing step's save
        assert sum(len(p) for p in on.pipelined) == sum(len(p) for p in off.pipelined)
        finish = f"EVALSHA {store.finish_script.sha}"
        (finishing,) = [p for p in on.pipelined if finish in p]
        assert f"EVALSHA {store.save_script.sha}" in finishing
        assert not any("XADD" in p for p in on.pipelined + off.pipelined)
        assert store.records.length() == 1
        assert RecordStream(redis_client, prefix + "x").length() == 0
    finally:
        for key in redis_client.scan_iter(f"{prefix}x:*"):
            redis_client.delete(key)


def test_the_stream_is_capped_approximately(redis_client, prefix):
    stream = RecordStream(redis_client, prefix, maxlen=100)
    pipe = redis_client.pipeline(transaction=False)
    for i in range(1000):
        stream.queue_append(pipe, f"r{i}", {"kind": "race", "race_id": f"r{i}"})
    pipe.execute()
    # MAXLEN ~ trims whole stream nodes (100 entries each by default): at least 100 are kept,
    # never much more, and the newest survive.
    assert 100 <= stream.length() <= 300
    assert [r["race_id"] for _, r in stream.read()][-1] == "r999"


def test_read_pages_through_a_time_window(redis_client, prefix):
    stream = RecordStream(redis_client, prefix)
    for i, ms in enumerate((1000, 2000, 2000, 3000, 4000)):
        redis_client.xadd(stream.keys[0], {"r": json.dumps({"n": i})}, id=f"{ms}-{i}")
    every = [r["n"] for _, r in stream.read(page=2)]
    assert every == [0, 1, 2, 3, 4]
    assert [r["n"] for _, r in stream.read(2000, 3000, page=1)] == [1, 2, 3]
    assert [r["n"] for _, r in stream.read(since_ms=3500)] == [4]
    assert [r["n"] for _, r in stream.read(until_ms=999)] == []


def test_export_writes_jsonl_between_since_and_until(redis_url, redis_client, prefix):
    shards = settings.current().race_shards(prefix, redis_url)  # where the CLI reads them
    stream = RecordStream(redis_client, prefix, shards=shards)
    # 2026-07-12T12:00:00Z is epoch 1783857600
    for i, s in enumerate((1783857599, 1783857600, 1783857660, 1783857720)):
        redis_client.xadd(stream.keys[0], {"r": json.dumps({"n": i})}, id=f"{s * 1000}-0")
    base = ["--redis-url", redis_url, "--prefix", prefix, "records", "export"]
    result = CliRunner().invoke(cli, base, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert [json.loads(line)["n"] for line in lines] == [0, 1, 2, 3]
    window = [*base, "--since", "2026-07-12T12:00:00Z", "--until", "1783857660"]
    result = CliRunner().invoke(cli, window, catch_exceptions=False)
    assert [json.loads(x)["n"] for x in result.stdout.splitlines() if x.strip()] == [1, 2]
    assert "exported 2 record(s)" in result.stderr


def test_export_rejects_bad_times_in_one_line(redis_url, prefix):
    base = ["--redis-url", redis_url, "--prefix", prefix, "records", "export"]
    result = CliRunner().invoke(cli, [*base, "--since", "yesterday"])
    assert result.exit_code == 2 and "bad --since 'yesterday'" in result.output
    result = CliRunner().invoke(cli, [*base, "--since", "200", "--until", "100"])
    assert result.exit_code == 2 and "is before --since" in result.output


def test_parse_time_accepts_iso_with_and_without_offset_and_epoch():
    assert parse_time("1783857600", "--since") == 1783857600.0
    assert parse_time("2026-07-12T12:00:00Z", "--since") == 1783857600.0
    assert parse_time("2026-07-12T12:00:00", "--since") == 1783857600.0  # UTC assumed
    assert parse_time("2026-07-12T14:00:00+02:00", "--since") == 1783857600.0
    with pytest.raises(BadInput):
        parse_time("-5", "--until")


def test_records_maxlen_setting():
    assert RaceSettings.from_env({}).records_maxlen == 100_000
    assert RaceSettings.from_env({"GPUHEDGE_RECORDS_MAXLEN": "0"}).records_maxlen == 0
    assert RaceSettings.from_env({"GPUHEDGE_RECORDS_MAXLEN": "5000"}).records_maxlen == 5000
    for bad in ("-1", "lots"):
        with pytest.raises(ConfigError, match="GPUHEDGE_RECORDS_MAXLEN"):
            RaceSettings.from_env({"GPUHEDGE_RECORDS_MAXLEN": bad})


def test_a_record_that_cannot_be_built_never_keeps_a_race_from_finishing(
    redis_client, prefix, monkeypatch
):
    import importlib

    receipt_module = importlib.import_module("gpuhedge_celery.race.receipt")

    def broken(*args, **kwargs):
        raise KeyError("a bug in building records")

    monkeypatch.setattr(receipt_module, "build_record", broken)
    store, _, effects = finish_fast_race(redis_client, prefix, "r1")
    assert store.receipt("r1")["winner_provider"] == "p"  # finished, receipt written
    assert store.records.length() == 0
