"""The GPU pool as a race provider, end to end: real Redis, real Celery workers, a sim hedge.

Workers (one module-wide set): a coordination worker (threads pool: ``hedged_infer``, attempt
tasks, race timers and the pool's waiters) and one CPU-runner GPU worker in pool ``rp``. The
config races ``gpu-pool`` (adapter ``pool``) against ``s`` (a sim serverless provider) in real
time (``time_scale: 1``); the pool's jobs last what the request's ``duration_s`` says.

Scenarios: "pool primary saturated -> state_aware cutover to sim serverless" (every
GPU busy, the pool attempt is still QUEUED at the cutover, leaves the wait queue at $0 with a
confirmed receipt, the sim hedge wins); the unsaturated case (a free GPU: the pool wins, no
hedge); and a running pool attempt that loses to the hedge (stopped, GPU freed, confirmed).
After each race: no lease held by the race, nobody left in the pool's queue, no sim job running.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from gpuhedge_celery.core.jobs import JobHandle
from gpuhedge_celery.providers.pool import PoolProvider
from gpuhedge_celery.providers.redis_ledger import sim_job_running
from gpuhedge_celery.tasks.app import TASK_POOLED_INFER
from gpuhedge_celery.tasks.cancel import cancel_pooled, running_on
from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.redis,
    pytest.mark.celery,
    pytest.mark.timeout(180),
    pytest.mark.brokers,
    pytest.mark.sentinel,
    pytest.mark.cluster,
]

POOL = "rp"
CONFIG = f"""
time_scale: 1
providers:
  gpu-pool:
    role: primary
    adapter: pool
    billed_rate_per_s: 0.0002       # a self-hosted GPU costs something too
    pool: {{name: {POOL}, poll_s: 0.05, cancel_confirm_s: 15}}
  s:
    role: hedge
    adapter: sim
    billed_rate_per_s: 0.0007
    sim:
      seed: 2
      slow_probability: 0
      fast: {{queue_s: 0.1, run_s: 0.3}}
      cancel: {{ack_s: 0.05, terminal_s: 0.1}}
policy:
  name: state_aware                 # real time: generous margins for a loaded 2-core machine
  params: {{queue_cutover_ms: 1500, safety_hedge_ms: 6000}}
timeouts:
  attempt_cap_s: 60
budget: {{ceiling_usd: 100}}        # the pool spends money: a ceiling is required
validator: nonempty
"""


class PoolRaces:
    """The workers, a race sender and audits of what a race left behind."""

    def __init__(self, cluster: Any, config_path: Any):
        from gpuhedge_celery.config import load_config
        from gpuhedge_celery.providers.simledger import RedisLedger
        from gpuhedge_celery.settings import ProcessSettings
        from gpuhedge_celery.store.connection import redis_from_url
        from gpuhedge_celery.store.races import RaceStore

        self.cluster = cluster
        self.app = cluster.app
        self.client = redis_from_url(cluster.redis_url, decode_responses=True)
        # where the workers put races (GPUHEDGE_RACE_SHARDS, its default from the Redis URL)
        shards = ProcessSettings.from_env().race_shards(cluster.prefix, cluster.redis_url)
        self.races = RaceStore(self.client, shards)
        self.ledger = RedisLedger(self.client, cluster.prefix)
        self.config = load_config(config_path)
        self.gpu = cluster.gpu_id(0)

    def provider(self, name: str) -> Any:
        if self.config.providers[name].adapter == "pool":
            return self.config.build(name, app=self.app, store=self.cluster.store)
        return self.config.build(name, ledger=self.ledger)

    def race(self, request: dict[str, Any], **kwargs: Any) -> tuple[dict, dict]:
        res = self.app.send_task(
            "gpuhedge.hedged_infer", (request,), kwargs, queue="gpuhedge.coord"
        )
        try:
            result = res.get(timeout=30)
            receipt = self.receipt(res.id)
        except Exception:
            print(self.cluster.logs())
            raise
        assert result["race_id"] == res.id == receipt["race_id"]
        return result, receipt

    def receipt(self, race_id: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.races.receipt(race_id)
            if found is not None:
                return found
            time.sleep(0.02)
        raise AssertionError(f"no receipt for race {race_id} after {timeout} s")

    def occupy(self, seconds: float = 60) -> str:
        """Fill every GPU of the pool with a long pooled job (not part of any race)."""
        res = self.app.send_task(
            TASK_POOLED_INFER, ({"duration_s": seconds, "id": "occupier"},), {"pool": POOL}
        )
        wait_for(lambda: running_on(self.cluster.store, POOL, res.id), 20, "the occupier to run")
        return res.id

    def free(self, task_id: str) -> None:
        cancel_pooled(self.cluster.store, POOL, task_id)
        wait_for(lambda: self.cluster.store.current(self.gpu) is None, 15, "the GPU to be freed")

    def assert_clean(self, receipt: dict[str, Any]) -> None:
        """Nothing of the race is left: no job running, no lease, no queue entry, no leak."""
        assert receipt["finished"] is True and receipt["leaks"] == []
        assert self.races.live_jobs(receipt["race_id"]) == {}
        job_ids = set()
        for a in receipt["attempts"]:
            if a.get("handle"):
                handle = JobHandle.from_dict(a["handle"])
                assert not sim_job_running(self.provider(a["provider"]), handle), a
                job_ids.add(handle.job_id)
        lease = self.cluster.store.current(self.gpu)
        assert lease is None or lease.holder not in job_ids, "a GPU lease left held by the race"
        assert not job_ids & set(self.cluster.store.queue(POOL)), "a race request left queued"
        for job_id in job_ids:
            assert running_on(self.cluster.store, POOL, job_id) is None


def attempt(receipt: dict[str, Any], provider: str) -> dict[str, Any]:
    return next(a for a in receipt["attempts"] if a["provider"] == provider)


@pytest.fixture(scope="module")
def pool_races(redis_url, tmp_path_factory, broker, request):
    from gpuhedge_celery.store.connection import redis_from_url
    from gpuhedge_celery.store.listener import enable_notifications
    from tests.support.fixtures_celery import CeleryCluster, broker_url_for
    from tests.support.fixtures_races import REPO

    enable_notifications(redis_from_url(redis_url))
    tmp = tmp_path_factory.mktemp("pool-races")
    config_path = tmp / "pool-races.yaml"
    config_path.write_text(CONFIG)
    prefix = f"t{uuid.uuid4().hex[:10]}"
    cluster = CeleryCluster(redis_url, prefix, tmp, broker_url_for(broker, request))
    cluster.env.update({"GPUHEDGE_CONFIG": str(config_path), "PYTHONPATH": str(REPO)})
    try:
        started = [
            cluster.start_gpu(0, pool=POOL, wait=False),
            cluster.start_coordinator(wait=False),
        ]
        cluster.wait_ready(*started)
        rc = PoolRaces(cluster, config_path)
        # warm the coordinator (imports, config, first provider builds) before any timing
        rc.race({"sim": {"s": {"queue_s": 0, "run_s": 0}}}, policy="single", providers=["s"])
        yield rc
    finally:
        cluster.close()
        client = redis_from_url(redis_url)
        keys = list(client.scan_iter(f"{cluster.prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def test_saturated_pool_primary_is_cut_over_to_the_sim_serverless_hedge(pool_races):
    rc = pool_races
    occupier = rc.occupy()
    tokens = rc.cluster.store.last_token(rc.gpu)
    try:
        request = {"duration_s": 0.2, "sim": {"s": {"queue_s": 0.1, "run_s": 0.3}}}
        result, receipt = rc.race(request, policy="state_aware", providers=["gpu-pool", "s"])
    finally:
        rc.free(occupier)
    assert result["winner"] == "s" and result["role"] == "hedge" and result["hedged"] is True
    assert receipt["cut_over"] is True and receipt["policy"].startswith("cutover:gpu-pool->s")
    pool = attempt(receipt, "gpu-pool")
    assert pool["phase"] == "cancelled"
    states = [label for _, label in pool["timeline"]]
    assert "QUEUED" in states and "IN_PROGRESS" not in states, states
    cancel = pool["cancel_receipt"]
    assert cancel["scope"] == "queued_job" and cancel["was_running"] is False
    assert cancel["evidence"] == "confirmed_terminal" and cancel["confirmed_terminal"] is True
    assert cancel["terminal_status"] == "CANCELLED" and cancel["leaked"] is False
    # the adapter's $0 comes with its cancel reply, unless a watch poll confirmed it first
    assert cancel["reconciled_cost_usd"] in (0.0, None)
    assert cancel["estimated_cost_usd"] in (0.0, None)
    assert receipt["wasted_usd"] == 0.0, "a request cancelled in the wait queue costs nothing"
    assert rc.cluster.store.last_token(rc.gpu) == tokens, "the race never got a GPU lease"
    rc.assert_clean(receipt)


def test_a_free_gpu_wins_without_a_hedge(pool_races):
    rc = pool_races
    request = {"duration_s": 0.3, "id": "free", "sim": {"s": {"queue_s": 0.1, "run_s": 0.3}}}
    result, receipt = rc.race(request, policy="state_aware", providers=["gpu-pool", "s"])
    assert result["winner"] == "gpu-pool" and result["role"] == "primary"
    assert result["hedged"] is False
    assert result["payload"]["echo"]["id"] == "free"  # the GPU runner's output
    assert [a["provider"] for a in receipt["attempts"]] == ["gpu-pool"]
    assert receipt["cut_over"] is False and receipt["receipts"] == []
    states = [label for _, label in attempt(receipt, "gpu-pool")["timeline"]]
    assert "IN_PROGRESS" in states and states[-1] == "COMPLETED (valid)", states
    assert rc.cluster.store.durations(POOL), "the GPU worker recorded the run"
    rc.assert_clean(receipt)


def test_a_running_pool_primary_that_loses_is_stopped_and_its_gpu_freed(pool_races):
    rc = pool_races
    # the pool's job runs 30 s; the fixed policy hedges after 1 s and the sim wins
    request = {"duration_s": 30, "sim": {"s": {"queue_s": 0.1, "run_s": 0.3}}}
    started = time.monotonic()
    result, receipt = rc.race(request, policy="hedge:gpu-pool->s@1s")
    assert time.monotonic() - started < 20, "the loser was stopped, not run to its end"
    assert result["winner"] == "s" and result["hedged"] is True
    cancel = attempt(receipt, "gpu-pool")["cancel_receipt"]
    assert cancel["was_running"] is True
    assert cancel["confirmed_terminal"] is True and cancel["terminal_status"] == "CANCELLED"
    assert cancel["leaked"] is False and cancel["evidence"] == "confirmed_terminal"
    if cancel["scope"] != "unknown":
        # The adapter's own receipt (GPU time, cost) is kept unless the race's watch saw the
        # stored "cancelled" end first: the engine then ignores the later acknowledgement.
        assert cancel["scope"] == "request" and cancel["billing_stop_confirmed"] is True
        assert cancel["execution_ms_before_cancel"] > 0
    assert rc.cluster.store.current(rc.gpu) is None, "the GPU's lease was released"
    rc.assert_clean(receipt)


def test_the_pool_as_hedge_takes_over_a_slow_serverless_primary(pool_races):
    rc = pool_races
    request = {"duration_s": 0.2, "sim": {"s": {"queue_s": 30, "run_s": 5}}}
    result, receipt = rc.race(request, policy="hedge:s->gpu-pool@0.5s")
    assert result["winner"] == "gpu-pool" and result["role"] == "hedge"
    primary = attempt(receipt, "s")["cancel_receipt"]
    assert primary["terminal_status"] == "CANCELLED" and primary["leaked"] is False
    rc.assert_clean(receipt)


def test_pool_provider_is_built_from_the_race_config(pool_races):
    assert isinstance(pool_races.provider("gpu-pool"), PoolProvider)
