"""The race driver on a real redis-server without Celery: duplicate deliveries are harmless.

The driver's effects are recorded instead of sent as tasks, so each test can replay exactly the
delivery a crash would cause (a second ``hedged_infer``, a second submit, a submit whose job was
registered just before the worker died) and check that no provider job is submitted twice and
the caller hears of the winner once per claim.
"""

from __future__ import annotations

import json
import os

import pytest

from gpuhedge_celery.config import parse_config_text
from gpuhedge_celery.core.jobs import JobHandle
from gpuhedge_celery.envvars import race_shards
from gpuhedge_celery.errors import StoreUnavailable
from gpuhedge_celery.providers.simledger import RedisLedger, seq_key
from gpuhedge_celery.race.attempts import SubmitHow
from gpuhedge_celery.race.backstops import cancel_backstop_id
from gpuhedge_celery.race.base import JobRef, RaceParts
from gpuhedge_celery.race.driver import RaceDriver
from gpuhedge_celery.race.settings import RaceSettings
from gpuhedge_celery.race.spec import build_spec
from gpuhedge_celery.store.race_keys import RaceShards, ResultWrite
from gpuhedge_celery.store.races import RaceStore
from gpuhedge_celery.store.timers import RaceTimers
from tests.support.fixtures_races import RACE_CONFIG

pytestmark = [pytest.mark.timeout(60), pytest.mark.cluster]

FAST = {"sim": {"p": {"queue_s": 0, "run_s": 0}}}
SLOW = {"sim": {"p": {"queue_s": 5, "run_s": 100}}}


class Recorder:
    """Effects that record what would have been sent."""

    def __init__(self) -> None:
        self.launched: list[tuple[str, str]] = []
        self.cancelled: list[tuple[str, str]] = []
        self.results: list[dict] = []
        self.failures: list[str] = []
        self.events: list[str] = []

    def launch(self, race_id, attempt_id, provider):
        self.launched.append((race_id, attempt_id))

    def cancel(self, race_id, attempt_id, provider):
        self.cancelled.append((race_id, attempt_id))

    def won(self, race_id, result, caller):
        self.results.append(result)

    def failed(self, race_id, message, receipt, caller):
        self.failures.append(message)

    def event(self, race_id, name, fields):
        self.events.append(name)


def race_stores(redis_client, prefix, shards=None) -> tuple[RaceStore, RaceTimers]:
    """A race store and its races' timers on ``shards`` race shards (None: as many as
    ``GPUHEDGE_RACE_SHARDS`` says, so scripts/cluster_compat.py runs them on a cluster's)."""
    layout = RaceShards(prefix, count=shards or race_shards(os.environ))
    return RaceStore(redis_client, layout), RaceTimers(redis_client, layout)


def build_driver(redis_client, prefix, effects, settings=None, config=RACE_CONFIG, shards=None):
    """A driver on the test config's sim providers (a Redis ledger) with ``effects``; returns
    the driver, the effects, the config, the ledger and the providers by name. ``config``:
    another YAML text; ``shards``: how many race shards (see :func:`race_stores`)."""
    cfg = parse_config_text(config)
    ledger = RedisLedger(redis_client, prefix)
    providers = {name: cfg.build(name, ledger=ledger) for name in cfg.providers}
    driver = RaceDriver(
        RaceParts(
            *race_stores(redis_client, prefix, shards),
            providers.__getitem__,
            effects,
            settings or RaceSettings(),
        )
    )
    return driver, effects, cfg, ledger, providers


@pytest.fixture
def setup(redis_client, prefix):
    return build_driver(redis_client, prefix, Recorder())


def submissions(ledger, provider="p") -> int:
    return int(ledger.get(seq_key(provider)) or 0)  # the sim numbers requests without sim_key


def test_a_redelivered_hedged_infer_resumes_instead_of_starting_again(setup):
    driver, effects, cfg, _, _ = setup
    assert driver.create("r1", SLOW, build_spec(cfg)) is True
    version = driver.store.load("r1").version
    assert driver.create("r1", SLOW, build_spec(cfg)) is False
    assert driver.store.load("r1").version == version  # nothing re-applied
    assert effects.launched == [("r1", "a1"), ("r1", "a1")]  # the launch is re-sent, once more


def test_a_submit_is_never_repeated(setup):
    driver, effects, cfg, ledger, _ = setup
    driver.create("r2", SLOW, build_spec(cfg))
    driver.submit_attempt("r2", "a1")
    driver.submit_attempt("r2", "a1")  # a duplicate delivery
    assert submissions(ledger) == 1
    jobs = driver.store.live_jobs("r2")
    assert list(jobs) == ["a1"]
    state = driver.store.load("r2").state["race"]
    assert state["attempts"][0]["job_id"] == jobs["a1"]["job_id"]
    assert state["attempts"][0]["phase"] == "running"


def test_a_job_registered_before_a_crash_is_reported_not_resubmitted(setup):
    driver, _, cfg, ledger, providers = setup
    driver.create("r3", SLOW, build_spec(cfg))
    # the first delivery submitted and registered the job, then its worker died
    handle = providers["p"].submit(SLOW)
    driver.store.add_job("r3", "a1", handle.to_dict())
    driver.submit_attempt("r3", "a1")  # the redelivery
    assert submissions(ledger) == 1
    attempt = driver.store.load("r3").state["race"]["attempts"][0]
    assert attempt["job_id"] == handle.job_id
    assert JobHandle.from_dict(attempt["handle"]) == handle


def failing_once(call):
    """``call``, whose first use raises StoreUnavailable (its answer lost on a cut link)."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise StoreUnavailable("Redis is unreachable (Connection closed by server.)")
        return call(*args, **kwargs)

    wrapped.calls = calls
    return wrapped


def test_a_submitted_job_is_registered_through_a_redis_blip(setup):
    driver, _, cfg, ledger, _ = setup
    driver.create("rb", SLOW, build_spec(cfg))
    driver.store.add_job = failing_once(driver.store.add_job)
    driver.submit_attempt("rb", "a1")
    assert submissions(ledger) == 1 and len(driver.store.add_job.calls) == 2
    assert list(driver.store.live_jobs("rb")) == ["a1"]
    assert driver.store.load("rb").state["race"]["attempts"][0]["phase"] == "running"


def test_past_the_submit_window_a_failed_registration_is_left_to_the_backstop(redis_client, prefix):
    """A handle registered after the launch backstop judged the submit unknown would sit
    under an ended attempt: with no window left the error goes through at once."""
    driver, _, cfg, ledger, _ = build_driver(
        redis_client, prefix, Recorder(), RaceSettings(launch_backstop_s=0.5)
    )
    driver.create("rw", SLOW, build_spec(cfg))
    driver.store.add_job = failing_once(driver.store.add_job)
    with pytest.raises(StoreUnavailable):
        driver.submit_attempt("rw", "a1")
    assert submissions(ledger) == 1 and len(driver.store.add_job.calls) == 1
    assert driver.store.live_jobs("rw")["a1"]["submitting"] is True  # the backstop's to judge


def test_a_fast_job_wins_inline_and_a_duplicate_result_changes_nothing(setup):
    driver, effects, cfg, _, providers = setup
    driver.create("r4", FAST, build_spec(cfg))
    driver.submit_attempt("r4", "a1")  # submits, polls at once: terminal, concluded inline
    assert [r["winner"] for r in effects.results] == ["p"]
    receipt = driver.store.receipt("r4")
    assert receipt["winner"] == "a1" and receipt["finished"] is True
    assert effects.events.count("won") == 1
    handle = JobHandle.from_dict(receipt["attempts"][0]["handle"])
    driver.conclude(JobRef("r4", "a1", "p", handle.to_dict(), 180.0))  # a second watch's answer
    assert len(effects.results) == 1 and driver.store.receipt("r4") == receipt


def test_the_winner_is_claimed_in_the_save_that_declares_it(setup):
    driver, effects, cfg, _, _ = setup
    separate = []
    claim_winner = driver.store.claim_winner
    driver.store.claim_winner = lambda *args: separate.append(args) or claim_winner(*args)
    driver.create("rw", FAST, build_spec(cfg))
    driver.submit_attempt("rw", "a1")
    assert [r["winner"] for r in effects.results] == ["p"]
    assert driver.store.winner("rw") == "a1" and separate == []  # no round trip of its own
    driver.resume("rw")  # a resumed race re-declares through a claim of its own: still a1
    assert separate == [("rw", "a1")] and driver.store.winner("rw") == "a1"


class Writing(Recorder):
    """Effects whose result backend is this Redis: the caller's result rides in the claim."""

    def __init__(self, prefix) -> None:
        super().__init__()
        self.prefix = prefix
        self.callers: list[dict] = []

    def result_write(self, race_id, result):
        return ResultWrite(f"{self.prefix}:caller:{race_id}", json.dumps(result), 60_000)

    def won(self, race_id, result, caller):
        self.callers.append(caller)
        super().won(race_id, result, caller)


@pytest.mark.one_redis  # Celery's results are never on a Redis Cluster store: no claim writes
def test_the_callers_result_is_written_by_the_claim_in_the_declaring_save(redis_client, prefix):
    driver, effects, cfg, _, _ = build_driver(redis_client, prefix, Writing(prefix))
    driver.create("rc", FAST, build_spec(cfg))
    driver.submit_attempt("rc", "a1")
    assert [r["winner"] for r in effects.results] == ["p"]
    # the key holds the very result the caller is handed, written before the handover
    assert json.loads(redis_client.get(f"{prefix}:caller:rc")) == effects.results[0]
    assert effects.callers[0]["result_stored"] is True  # so the effects do not write it again
    assert 0 < redis_client.pttl(f"{prefix}:caller:rc") <= 60_000
    driver.resume("rc")  # a resumed race re-declares by a claim of its own: the effects write
    assert len(effects.callers) == 2 and "result_stored" not in effects.callers[1]
    assert effects.results[1] == effects.results[0]


def test_resume_of_a_finished_race_only_re_marks_the_same_result(setup):
    driver, effects, cfg, _, _ = setup
    driver.create("r5", FAST, build_spec(cfg))
    driver.submit_attempt("r5", "a1")
    receipt = driver.store.receipt("r5")
    driver.resume("r5")  # e.g. a redelivered hedged_infer after the race ended
    # the declaring step may have died before marking: the same result is handed over again
    # (Celery's effects skip a task id already marked done), and nothing else happens
    assert [r == effects.results[0] for r in effects.results] == [True, True]
    assert driver.store.receipt("r5") == receipt
    assert effects.launched == [("r5", "a1")] and effects.cancelled == []  # nothing re-sent


def test_resume_of_a_won_race_still_cancelling_repeats_the_same_result_and_cancel(setup):
    driver, effects, cfg, _, _ = setup
    request = {"sim": {"p": {"queue_s": 0, "run_s": 100}, "h": {"queue_s": 0, "run_s": 0}}}
    driver.create("r7", request, build_spec(cfg, policy="hedge:p->h@0s"))
    assert effects.launched == [("r7", "a1"), ("r7", "a2")]  # an immediate race
    driver.submit_attempt("r7", "a1")
    driver.submit_attempt("r7", "a2")  # the hedge answers at once and wins
    assert [r["winner"] for r in effects.results] == ["h"]
    assert effects.cancelled == [("r7", "a1")] and driver.store.receipt("r7") is None
    driver.resume("r7")  # as if the step's process died before its actions
    assert len(effects.results) == 2 and effects.results[0] == effects.results[1]
    assert effects.cancelled == [("r7", "a1"), ("r7", "a1")]
    assert driver.store.winner("r7") == "a2"


def test_unknown_races_and_attempts_are_ignored(setup):
    driver, effects, cfg, _, _ = setup
    driver.submit_attempt("nope", "a1")
    driver.cancel_attempt("nope", "a1")
    assert driver.step("nope", lambda race: None) is None
    driver.create("r6", SLOW, build_spec(cfg))
    driver.submit_attempt("r6", "a9")  # no such attempt
    assert effects.launched == [("r6", "a1")] and effects.results == []


def test_a_redelivered_submit_re_performs_what_a_dead_step_left_undone(setup, redis_client):
    driver, _, cfg, _, _ = setup
    driver.create("r8", SLOW, build_spec(cfg))
    driver.submit_attempt("r8", "a1")
    # the race's deadline, the hedge timer and the job's next watch poll
    timers = driver.timers.of("r8")
    assert timers.pending() == 3
    # the worker died after saving AttemptSubmitted, before arming anything
    redis_client.delete(timers.keys.due, timers.keys.data)
    driver.submit_attempt("r8", "a1")  # the redelivery
    assert timers.pending() == 3
    assert driver.store.live_jobs("r8").keys() == {"a1"}


def _another_process(redis_client, prefix, providers) -> RaceDriver:
    """A second driver on the same Redis, as another coordination worker would have."""
    return RaceDriver(RaceParts(
        *race_stores(redis_client, prefix),
        providers.__getitem__, Recorder(), RaceSettings(),
    ))  # fmt: skip


def test_a_step_on_a_stale_copy_of_the_race_is_checked_against_redis(setup, redis_client, prefix):
    # This process saved the race last, then another process moved it on. An event that is a
    # no-op on the stale copy must not be dropped: the step re-reads Redis and applies it.
    from gpuhedge_celery.core.attempts import Phase
    from gpuhedge_celery.core.jobs import JobState
    from gpuhedge_celery.core.race_events import AttemptSubmitted, StatusObserved

    driver, effects, cfg, _, providers = setup
    assert driver.create("r9", SLOW, build_spec(cfg)) is True  # a1 launching, cached here
    other = _another_process(redis_client, prefix, providers)
    handle = providers["p"].submit(SLOW)
    other.step("r9", AttemptSubmitted("a1", handle.job_id, handle.to_dict()))
    assert driver.store.load("r9", fresh=True).cached  # the stale copy is still here

    def seen_running(race):  # like the driver's own sources: None means "nothing to do"
        running = race.attempts[0].phase is Phase.RUNNING
        return StatusObserved("a1", JobState.IN_PROGRESS) if running else None

    # On the stale copy a1 is still launching, so there is nothing to do; on Redis it runs.
    saved = driver.step("r9", seen_running)
    a1 = saved.attempts[0]
    assert a1.job_id == handle.job_id
    assert any(label == JobState.IN_PROGRESS.value for _, label in a1.timeline), a1.timeline


def test_a_step_whose_save_conflicts_decides_again_from_the_state_it_was_answered_with(
    setup, redis_client, prefix, monkeypatch
):
    # The stale copy says a1 is launching; another process has registered its job since. The
    # step's save conflicts, and the script's answer carries the race as it is: the step
    # decides again from that (a duplicate report: nothing more to do) with no read of its own.
    from gpuhedge_celery.core.race_events import AttemptSubmitted

    driver, _, cfg, _, providers = setup
    assert driver.create("r10", SLOW, build_spec(cfg)) is True  # a1 launching, cached here
    other = _another_process(redis_client, prefix, providers)
    handle = providers["p"].submit(SLOW)
    submitted = AttemptSubmitted("a1", handle.job_id, handle.to_dict())
    other.step("r10", submitted)
    version = other.store.load("r10").version
    reads = []
    load = driver.store.load

    def counted(race_id, *, fresh=False):
        found = load(race_id, fresh=fresh)
        if found is not None and not found.cached:
            reads.append(race_id)
        return found

    monkeypatch.setattr(driver.store, "load", counted)
    saved = driver.step("r10", submitted)  # the same report, delivered here too
    assert reads == []  # the conflict's answer was the read
    assert saved.attempts[0].job_id == handle.job_id
    assert other.store.load("r10").version == version  # nothing applied twice


def test_a_redelivered_watch_poll_leaves_its_job_one_chain_of_polls(setup):
    # Its first claimer died; the second delivery polls, arms the next poll and resumes the
    # race, which must not arm a second poll for the same job (two chains from then on).
    import time

    driver, _, cfg, _, _ = setup
    driver.create("rw2", {"sim": {"p": {"queue_s": 2, "run_s": 100}}},
                  build_spec(cfg, policy="hedge:p->h@60s"))  # fmt: skip
    driver.submit_attempt("rw2", "a1")
    time.sleep(0.05)  # the queued -> running poll is due

    timers = driver.timers.of("rw2")

    def watch_ids():
        keys = timers.keys
        ids = timers.client.zrange(keys.due, 0, -1)
        ids += timers.client.zrange(keys.inflight, 0, -1)
        return [t for t in ids if t.startswith("rw2:w:")]

    now = int(driver.clock.now() * 1000)
    (first,) = [t for t in timers.claim_due(now, 10, 50) if t.payload["kind"] == "watch"]
    time.sleep(0.1)  # its claimer died: the lease runs out
    now = int(driver.clock.now() * 1000)
    (again,) = [t for t in timers.claim_due(now, 10, 10_000)
                if t.payload["kind"] == "watch"]  # fmt: skip
    assert again.id == first.id and again.deliveries == 2
    driver.on_timer(again)
    timers.ack(again)
    assert len(watch_ids()) == 1, watch_ids()


def _watch_timers(driver, race_id):
    """The ids of the race's watch polls waiting or in flight."""
    timers = driver.timers.of(race_id)
    ids = timers.client.zrange(timers.keys.due, 0, -1)
    ids += timers.client.zrange(timers.keys.inflight, 0, -1)
    return sorted(t for t in ids if t.startswith(f"{race_id}:w:"))


def test_a_resume_arms_a_poll_only_for_a_job_whose_chain_of_polls_is_gone(setup):
    # A redelivered task (or a policy timer whose claimer died) resumes the race without
    # knowing whether the crash broke a job's chain of polls; a second chain would poll the
    # job twice as often until it ends.
    driver, _, cfg, _, _ = setup
    driver.create("rc1", {"sim": {"p": {"queue_s": 2, "run_s": 100}}},
                  build_spec(cfg, policy="hedge:p->h@60s"))  # fmt: skip
    driver.submit_attempt("rc1", "a1")
    (chain,) = _watch_timers(driver, "rc1")
    driver.resume("rc1")
    driver.resume("rc1")
    assert _watch_timers(driver, "rc1") == [chain]
    # its poll in flight (a claimer at work on it) is alive too
    now = int(driver.clock.now() * 1000) + 10_000
    (claimed,) = [t for t in driver.timers.of("rc1").claim_due(now, 10, 10_000) if t.id == chain]
    driver.resume("rc1")
    assert _watch_timers(driver, "rc1") == [chain]
    # the chain lost (its poll dropped after its last failed delivery, or Redis lost it):
    # the resume arms a new one, once
    assert driver.timers.of("rc1").ack(claimed)
    assert _watch_timers(driver, "rc1") == []
    driver.resume("rc1")
    (again,) = _watch_timers(driver, "rc1")
    driver.resume("rc1")
    assert _watch_timers(driver, "rc1") == [again]


def test_a_result_nested_too_deep_to_store_ends_its_attempt_invalid(setup):
    from gpuhedge_celery.core.jobs import AttemptResult, JobState

    driver, _, cfg, _, providers = setup
    driver.create("deep", SLOW, build_spec(cfg, validator="nonempty"))  # any JSON passes
    driver.submit_attempt("deep", "a1")
    record = driver.store.load("deep")
    handle = JobHandle.from_dict(record.state["race"]["attempts"][0]["handle"])
    payload: dict = {}
    for _ in range(300):  # deeper than the store's JSON encoder goes
        payload = {"x": payload}
    deep = AttemptResult("p", handle.job_id, JobState.COMPLETED, 1000.0, payload=payload)
    driver.conclude(JobRef("deep", "a1", "p", handle.to_dict(), 60.0), record.state["spec"], deep)
    state = driver.store.load("deep").state
    assert state["results"]["a1"]["valid"] is False
    assert "cannot be stored as JSON" in " ".join(state["results"]["a1"]["reasons"])
    assert state["race"]["winner"] is None


def test_reports_that_drop_a_backstop_survive_a_server_that_forgot_its_scripts(private_redis):
    # A submit's failure and a loser's cancel are each reported in a save that drops their
    # backstop timer with a script; after a restart or SCRIPT FLUSH that save must load every
    # script it sends, or the step is saved but its actions (the next attempt, the finish's
    # events) never run and the backstop fires for nothing.
    import redis

    client = redis.Redis.from_url(private_redis.url, decode_responses=True)
    driver, effects, cfg, _, _ = build_driver(client, "flush", Recorder())
    failing = {"sim": {"p": {"outcome": "submit_error"}, "h": {"queue_s": 0, "run_s": 0}}}
    driver.create("s1", failing, build_spec(cfg, policy="hedge:p->h@10s"))
    key, due, payload, backstop = driver.submitter.launch_backstop("s1", "a1")
    driver.timers.of("s1").arm(key, due, payload, timer_id=backstop)  # as an inline launch does
    client.script_flush()
    driver.submit_attempt("s1", "a1", SubmitHow(decided_here=True, backstop=backstop))
    assert driver.timers.of("s1").due_time(backstop) is None  # dropped with the report
    assert effects.launched == [("s1", "a1"), ("s1", "a2")]  # its failure launched the hedge
    hedged = {"sim": {"p": {"queue_s": 0, "run_s": 100}, "h": {"queue_s": 0, "run_s": 0}}}
    driver.create("s2", hedged, build_spec(cfg, policy="hedge:p->h@0s"))
    driver.submit_attempt("s2", "a1")
    driver.submit_attempt("s2", "a2")  # the hedge answers at once and wins
    assert effects.cancelled == [("s2", "a1")]
    client.script_flush()
    driver.cancel_attempt("s2", "a1")
    assert driver.timers.of("s2").due_time(cancel_backstop_id("s2", "a1")) is None
    assert driver.store.receipt("s2")["winner"] == "a2"
    assert "loser_cancelled" in effects.events
