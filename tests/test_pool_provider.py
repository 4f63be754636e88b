"""The ``pool`` adapter's contract rows against a REAL pool: real Redis, real Celery workers.

One coordination worker (threads pool: ``pooled_infer`` waits there) and one CPU-runner GPU
worker per module; the provider under test runs in the test process, sending ``pooled_infer``
by name through the cluster's app, exactly as a race's attempt worker does. Pure tables for the
config block and the stored-meta mapping need no server.
"""

from __future__ import annotations

import time
import uuid

import pytest

from gpuhedge_celery.config import parse_config_text
from gpuhedge_celery.core.jobs import JobHandle, JobState
from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.providers import build_provider
from gpuhedge_celery.providers.pool import PoolProvider, PoolSpec, _epoch, _meta_state
from gpuhedge_celery.runners import RunnerStopped
from gpuhedge_celery.tasks.app import TASK_POOLED_INFER
from gpuhedge_celery.tasks.cancel import running_on
from tests.support.waiting import wait_for

pytestmark = pytest.mark.brokers  # the real-pool rows run on Redis and on RabbitMQ

POOL = "pp"

# --------------------------------------------------------------------------- pure tables


def _config(block: str) -> str:
    return f"providers:\n  gp:\n    role: primary\n    adapter: pool\n{block}"


@pytest.mark.parametrize(
    "block, message",
    [
        ("", "providers.gp.pool.name: required key is missing"),
        ("    pool: {name: 'a b'}\n", "pool.name: invalid pool name 'a b': expected 1-200 letters"),
        ("    pool: {name: 'a:b'}\n", "pool.name: invalid pool name 'a:b': expected 1-200 letters"),
        ("    pool: {name: a, lables: {}}\n", "pool.lables: unknown key; did you mean 'labels'?"),
        ("    pool: {name: a, poll_s: 0}\n", "pool.poll_s: expected a number > 0, got 0"),
        ("    pool: {name: a, labels: {m: [1]}}\n", "pool.labels.m: expected a string value"),
        ("    pool: {name: a, cancel_confirm_s: x}\n", "pool.cancel_confirm_s: expected a number"),
        ("    pool: [a]\n", "providers.gp.pool: expected a mapping"),
    ],
)
def test_bad_pool_blocks_are_one_line_errors(block, message):
    with pytest.raises(ConfigError) as info:
        parse_config_text(_config(block), source="p.yaml")
    text = str(info.value)
    assert text.startswith("p.yaml: ") and message in text and "\n" not in text


def test_pool_block_builds_a_pool_provider_with_its_rate():
    cfg = parse_config_text(
        _config("    billed_rate_per_s: 0.0004\n    pool: {name: a100, labels: {model: x}}\n")
        + "budget: {ceiling_usd: 100}\n"  # the pool counts as spending money
    )
    spec = cfg.providers["gp"].spec
    assert spec == PoolSpec("a100", {"model": "x"}, 0.5, 10.0)
    provider = build_provider("gp", cfg.providers["gp"], ledger=object())  # others' kwargs
    assert isinstance(provider, PoolProvider) and provider.reports_queue_state is True
    assert provider.billed_rate_per_s == 0.0004 and provider.cost_usd(10) == pytest.approx(0.004)
    assert repr(provider) == "PoolProvider(name='gp', pool='a100')"


def _named(name: str, message: str) -> Exception:
    return type(name, (Exception,), {})(message)


@pytest.mark.parametrize(
    "meta, state",
    [
        ({"status": "PENDING"}, None),
        ({"status": "STARTED"}, None),
        ({"status": "RETRY"}, None),
        ({"status": "SUCCESS", "result": {}}, JobState.COMPLETED),
        ({"status": "REVOKED"}, JobState.CANCELLED),
        ({"status": "FAILURE", "result": ValueError("boom")}, JobState.FAILED),
        ({"status": "FAILURE", "result": _named("RunnerStopped", "x cancelled while running")},
         JobState.CANCELLED),
        ({"status": "FAILURE", "result": _named("AcquireTimeout", "the wait was cancelled")},
         JobState.CANCELLED),
        ({"status": "FAILURE", "result": _named("AcquireTimeout", "no GPU within 3 s")},
         JobState.FAILED),
        ({"status": "FAILURE", "result": _named("RunnerStopped", "lease lost")}, JobState.FAILED),
        ({"status": "FAILURE",
          "result": {"exc_type": "RunnerStopped", "exc_message": ["r cancelled while running"]}},
         JobState.CANCELLED),
    ],
)  # fmt: skip
def test_stored_meta_maps_to_job_states(meta, state):
    assert _meta_state(meta) is state


def test_date_done_is_read_as_utc():
    assert _epoch("2026-01-01T00:00:00") == 1767225600.0
    assert _epoch("2026-01-01T00:00:00+00:00") == 1767225600.0
    assert _epoch("yesterday") is None and _epoch(None) is None


# --------------------------------------------------------------------------- a real pool


@pytest.fixture(scope="module")
def pool(redis_url, tmp_path_factory, broker, request):
    """One coordinator and one CPU-runner GPU worker in pool ``pp`` (module-wide)."""
    from gpuhedge_celery.store.connection import redis_from_url
    from gpuhedge_celery.store.listener import enable_notifications
    from tests.support.fixtures_celery import CeleryCluster, broker_url_for

    enable_notifications(redis_from_url(redis_url))
    prefix, tmp = f"t{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("pp")
    cluster = CeleryCluster(redis_url, prefix, tmp, broker_url_for(broker, request))
    try:
        started = [
            cluster.start_gpu(0, pool=POOL, wait=False),
            cluster.start_coordinator(wait=False),
        ]
        cluster.wait_ready(*started)
        yield cluster
    finally:
        cluster.close()
        client = redis_from_url(redis_url)
        keys = list(client.scan_iter(f"{cluster.prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture
def provider(pool):
    spec = PoolSpec(POOL, poll_s=0.05, cancel_confirm_s=15.0)
    return PoolProvider("gp", spec, app=pool.app, store=pool.store, billed_rate_per_s=0.001)


def _twin(pool, provider, handle):
    """Another provider instance (another process's view) and the handle after a JSON trip."""
    other = PoolProvider("gp", provider.spec, app=pool.app, store=pool.store)
    return other, JobHandle.from_json(handle.to_json())


def _states_until_terminal(provider, handle, timeout_s=20.0):
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = provider.status(handle)
        if not seen or seen[-1] is not state:
            seen.append(state)
        if state.terminal:
            return seen
        time.sleep(0.01)
    raise AssertionError(f"not terminal after {timeout_s}s: {seen}")


@pytest.mark.redis
@pytest.mark.celery
@pytest.mark.timeout(120)
def test_submit_returns_at_once_then_queued_running_completed(pool, provider):
    started = time.monotonic()
    handle = provider.submit({"duration_s": 0.6, "id": "a"})
    assert time.monotonic() - started < 0.5, "submit only sends the message"
    assert handle.provider == "gp" and handle.job_id.startswith("pool-")
    other, copy = _twin(pool, provider, handle)
    states = _states_until_terminal(other, copy)
    assert states[-1] is JobState.COMPLETED and JobState.IN_PROGRESS in states
    assert set(states) <= {JobState.QUEUED, JobState.IN_PROGRESS, JobState.COMPLETED}
    assert states.index(JobState.IN_PROGRESS) < len(states) - 1

    result = provider.result(handle, cap_s=30)
    assert result.state is JobState.COMPLETED and result.error is None
    assert result.payload["echo"] == {"duration_s": 0.6, "id": "a"}  # the runner's output
    assert result.metrics["gpu_id"] == pool.gpu_id(0) and result.metrics["pool"] == POOL
    # the runner's 0.6 s, measured: a loaded machine adds to it, never takes from it
    assert 590 <= result.metrics["execution_ms"] < 1_500
    assert result.metrics["cost_usd"] == pytest.approx(result.metrics["execution_ms"] / 1e6)
    assert 0 <= result.metrics["delay_ms"] < result.wall_ms
    assert result.wall_ms >= 600
    assert [e.stage for e in result.events] == ["running", "completed"]
    # already terminal: result() answers at once, the same in another process
    started = time.monotonic()
    assert other.result(copy, cap_s=30).state is JobState.COMPLETED
    assert time.monotonic() - started < 0.5

    # cancelling a job that already ended stops nothing and says so
    receipt = provider.cancel(handle)
    assert receipt.confirmed_terminal and receipt.terminal_status is JobState.COMPLETED
    assert receipt.was_running is False and "already ended" in receipt.note
    assert pool.store.current(pool.gpu_id(0)) is None


@pytest.mark.redis
@pytest.mark.celery
@pytest.mark.timeout(120)
def test_many_jobs_polled_at_once_read_as_each_one_alone(pool, provider):
    # one GPU: one job runs, the other waits behind it (either may be first); a third handle
    # names a job that was never sent
    first = provider.submit({"duration_s": 1.0, "id": "m1"})
    second = provider.submit({"duration_s": 1.0, "id": "m2"})
    never = JobHandle("gp", "pool-never-sent", time.time(), extra={"pool": POOL})
    handles = [first, second, never]
    running = {JobState.IN_PROGRESS}
    wait_for(lambda: {provider.status(first), provider.status(second)} & running, 20,
             "one job running")  # fmt: skip
    many = provider.status_and_next_change_many(handles)
    assert [state for state, _ in many] == [provider.status(h) for h in handles]
    assert sorted(state.value for state, _ in many[:2]) == ["IN_PROGRESS", "QUEUED"]
    assert many[2][0] is JobState.QUEUED
    assert all(at is not None and at > time.time() for _, at in many)  # look again soon
    wait_for(lambda: provider.status(first).terminal and provider.status(second).terminal, 20,
             "both jobs done")  # fmt: skip
    many = provider.status_and_next_change_many(handles)
    assert many[:2] == [(JobState.COMPLETED, None), (JobState.COMPLETED, None)]
    assert many[2][0] is JobState.QUEUED


@pytest.mark.redis
@pytest.mark.celery
@pytest.mark.timeout(120)
def test_a_failed_job_reads_failed_with_its_error(pool, provider):
    handle = provider.submit({"duration_s": "not-a-number"})  # the CPU runner raises
    assert _states_until_terminal(provider, handle)[-1] is JobState.FAILED
    result = provider.result(handle, cap_s=30)
    assert result.state is JobState.FAILED and "ValueError" in result.error
    assert result.payload is None
    wait_for(lambda: pool.store.current(pool.gpu_id(0)) is None, 5, "the lease released")


@pytest.mark.redis
@pytest.mark.celery
@pytest.mark.timeout(120)
def test_queued_cancel_leaves_the_queue_at_no_cost_and_running_cancel_frees_the_gpu(pool, provider):
    gpu = pool.gpu_id(0)
    tokens_before = pool.store.last_token(gpu)
    busy = provider.submit({"duration_s": 30, "id": "busy"})
    # IN_PROGRESS from the lease on, before the GPU worker's running record exists
    wait_for(lambda: provider.status(busy) is JobState.IN_PROGRESS, 20, "the long job's lease")
    wait_for(lambda: running_on(pool.store, POOL, busy.job_id) == gpu, 20, "the job to run")
    assert provider.status(busy) is JobState.IN_PROGRESS
    queued = provider.submit({"duration_s": 0.2, "id": "queued"})
    wait_for(lambda: queued.job_id in pool.store.queue(POOL), 20, "the second to queue")
    assert provider.status(queued) is JobState.QUEUED

    # result() is right-censored at the cap, measured from submit, and leaves the job alone
    cap_s = (time.time() - queued.submitted_at) + 0.3
    started = time.monotonic()
    capped = provider.result(queued, cap_s=cap_s)
    assert capped.state is JobState.TIMEOUT and capped.wall_ms == pytest.approx(cap_s * 1000)
    assert time.monotonic() - started < 2.0
    assert provider.status(queued) is JobState.QUEUED

    receipt = provider.cancel(queued)
    assert receipt.scope.value == "queued_job" and receipt.was_running is False
    assert receipt.evidence.value == "confirmed_terminal" and receipt.leaked is False
    assert receipt.terminal_status is JobState.CANCELLED
    assert receipt.estimated_cost_usd == 0.0 and receipt.reconciled_cost_usd == 0.0
    assert receipt.execution_ms_before_cancel == 0.0
    assert receipt.cancel_sent_ms <= receipt.cancel_ack_ms <= receipt.terminal_ms
    assert queued.job_id not in pool.store.queue(POOL)
    wait_for(lambda: provider.status(queued) is JobState.CANCELLED, 10, "stored as cancelled")
    held = pool.store.current(gpu)  # the busy job's lease, the last one issued
    assert held.token == pool.store.last_token(gpu) > tokens_before, "the queued got no lease"

    started = time.monotonic()
    receipt = provider.cancel(busy)
    assert time.monotonic() - started < 10, "stopped, not run to its 30 s end"
    assert receipt.was_running is True and receipt.scope.value == "request"
    assert receipt.confirmed_terminal and receipt.terminal_status is JobState.CANCELLED
    assert receipt.leaked is False and receipt.billing_stop_confirmed is True
    assert 0 < receipt.execution_ms_before_cancel < 15_000
    assert receipt.reconciled_cost_usd == pytest.approx(
        receipt.execution_ms_before_cancel / 1000 * 0.001
    )
    assert gpu in receipt.note
    # confirmed means: the GPU runs nothing and its lease is free, at the moment we return
    assert running_on(pool.store, POOL, busy.job_id) is None
    assert pool.store.current(gpu) is None
    with pytest.raises(RunnerStopped, match="cancelled while running"):
        pool.app.AsyncResult(busy.job_id).get(timeout=10)
    assert provider.status(busy) is JobState.CANCELLED

    # the freed GPU serves the next request at once
    after = provider.submit({"duration_s": 0.1})
    assert provider.result(after, cap_s=20).state is JobState.COMPLETED


@pytest.mark.redis
@pytest.mark.celery
@pytest.mark.timeout(120)
def test_a_request_cancelled_before_it_is_picked_up_never_takes_a_gpu(pool, provider):
    gpu = pool.gpu_id(0)
    busy = provider.submit({"duration_s": 30, "id": "busy2"})
    wait_for(lambda: provider.status(busy) is JobState.IN_PROGRESS, 20, "the long job to run")
    tokens = pool.store.last_token(gpu)
    # a handle whose message is not sent yet: the cancel finds it in no queue and on no GPU
    early = JobHandle("gp", f"pool-early-{uuid.uuid4().hex[:8]}", time.time(), {"pool": POOL})
    ghost = PoolProvider("gp", PoolSpec(POOL, poll_s=0.05, cancel_confirm_s=0.5),
                         app=pool.app, store=pool.store)  # fmt: skip
    receipt = ghost.cancel(early)
    assert receipt.leaked is True and receipt.evidence.value == "provider_ack"
    assert "not confirmed within 0.5 s" in receipt.note
    pool.app.send_task(TASK_POOLED_INFER, ({"duration_s": 0.1},), {"pool": POOL},
                       task_id=early.job_id)  # fmt: skip
    assert _states_until_terminal(provider, early)[-1] is JobState.CANCELLED
    assert "before it waited" in provider.result(early, cap_s=10).error
    assert pool.store.last_token(gpu) == tokens
    provider.cancel(busy)
    wait_for(lambda: pool.store.current(gpu) is None, 10, "the GPU freed")


# The provider the demo should race (docs/adding-a-provider.md); appended to demo.yaml's
# providers it must load, and state_aware must race it against sim-steady by name.
def test_the_demo_pool_provider_races_by_name_with_state_aware():
    from gpuhedge_celery.config import load_config, packaged_path
    from gpuhedge_celery.race.spec import build_spec

    # the packaged demo config carries the pool provider, raced by name
    cfg = load_config(packaged_path("demo.yaml"))
    assert [p.name for p in cfg.by_role("fallback")][0] == "sim-reserve"
    spec = build_spec(cfg, "state_aware", ["gpu-pool", "sim-steady"], "nonempty")
    assert spec.policy.providers() == ("gpu-pool", "sim-steady")
    assert spec.caps_s["gpu-pool"] == pytest.approx(60 * cfg.time_scale)
    assert isinstance(cfg.build("gpu-pool"), PoolProvider)


@pytest.mark.redis
@pytest.mark.celery
@pytest.mark.timeout(120)
def test_an_unknown_pool_fails_the_attempt_with_a_typed_error(pool):
    nowhere = PoolProvider("gp", PoolSpec("no-such-pool", poll_s=0.05), app=pool.app,
                           store=pool.store)  # fmt: skip
    handle = nowhere.submit({"duration_s": 0.1})
    result = nowhere.result(handle, cap_s=20)
    assert result.state is JobState.FAILED and "UnknownPool" in result.error


@pytest.mark.redis
def test_redis_unreachable_is_a_provider_error_and_a_leaked_receipt(private_redis):
    import redis

    from gpuhedge_celery.errors import ProviderError, SubmitError
    from gpuhedge_celery.settings import Settings
    from gpuhedge_celery.store.leases import LeaseStore
    from gpuhedge_celery.tasks.app import create_app
    from gpuhedge_celery.tasks.config import GlueConfig

    url = private_redis.url
    app = create_app(GlueConfig(settings=Settings(redis_url=url, prefix="gone")))
    no_retry = {"max_retries": 0}
    app.conf.broker_transport_options = no_retry
    app.conf.result_backend_transport_options = {"retry_policy": no_retry}
    store = LeaseStore(redis.Redis.from_url(url, decode_responses=True, socket_timeout=2), "gone")
    provider = PoolProvider("gp", PoolSpec(POOL, poll_s=0.05), app=app, store=store)
    handle = JobHandle("gp", "pool-x", time.time(), {"pool": POOL})
    private_redis.stop()
    with pytest.raises(ProviderError, match="provider 'gp': cannot read the lease table"):
        provider.status(handle)
    receipt = provider.cancel(handle)
    assert receipt.leaked is True and receipt.evidence.value == "no_evidence"
    assert receipt.note.startswith("cancel failed:") and "\n" not in receipt.note
    result = provider.result(handle, cap_s=5)
    assert result.state is JobState.FAILED and "unreachable" in result.error
    with pytest.raises(SubmitError, match="could not send gpuhedge.pooled_infer") as info:
        provider.submit({"x": 1})
    assert "\n" not in str(info.value)
