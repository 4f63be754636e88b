"""Every script and pipeline of the lease table, the wait queues and pooled requests keeps to one
Redis Cluster slot (the pool's hash tag), checked on plain Redis, where the store runs on a client
that records the slot of every key each script call and pipeline names, and (``[cluster]``) on a
Redis Cluster, which refuses any that does not."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from redis.commands.core import Script
from redis.crc import key_slot

from gpuhedge_celery.core.lease_rules import GpuInfo
from gpuhedge_celery.store.availability import drain, undrain
from gpuhedge_celery.store.direct import DirectClaims
from gpuhedge_celery.store.keys import check_pool
from gpuhedge_celery.store.leases import LeaseStore
from gpuhedge_celery.store.listener import close_listeners
from gpuhedge_celery.store.liveness import ProcessBeat
from gpuhedge_celery.store.pooled import PooledRecords
from gpuhedge_celery.store.scripts import _lua_source
from gpuhedge_celery.store.waiter import LeaseWaiter
from gpuhedge_celery.tasks.gpu_steps import RunningRecord, begin, finish

pytestmark = [pytest.mark.redis, pytest.mark.cluster]

SCRIPTS = (
    "claim", "renew", "release", "check_fence", "restore", "force_release", "fence_lift",
    "gpu_finish", "wait_claim", "leave", "out_clear", "proc_beat", "pooled_take",
    "pooled_handoff", "pooled_requeue", "pooled_dead_takers", "pooled_direct",
)  # fmt: skip
MULTI_KEY = {"DEL", "EXISTS", "MGET", "UNLINK", "TOUCH"}
KEYLESS = {"PUBLISH", "TIME", "PING", "PUBSUB", "SCRIPT", "CONFIG", "CLIENT", "INFO"}


def _slots(keys: list[Any]) -> set[int]:
    return {key_slot(k.encode() if isinstance(k, str) else k) for k in keys}


class SlotLog:
    """What the store sent: script name -> calls, and every script or pipeline whose keys
    lay in more than one slot."""

    def __init__(self) -> None:
        self.names = {hashlib.sha1(_lua_source(n).encode()).hexdigest(): n for n in SCRIPTS}
        self.calls: dict[str, int] = {}
        self.spread: list[str] = []

    def script(self, sha: str, keys: list[Any]) -> None:
        name = self.names.get(sha, sha)
        self.calls[name] = self.calls.get(name, 0) + 1
        if len(_slots(keys)) > 1:
            self.spread.append(f"{name}: {keys}")

    def pipeline(self, stack: list[Any]) -> None:
        keys: list[Any] = []
        for args, _options in stack:
            command = str(args[0]).upper()
            if command in ("EVALSHA", "EVAL"):
                keys += list(args[3 : 3 + int(args[2])])
            elif command in MULTI_KEY:
                keys += list(args[1:])
            elif command not in KEYLESS and len(args) > 1:
                keys.append(args[1])
        if len(_slots(keys)) > 1:
            self.spread.append(f"pipeline: {keys}")


class SlotPipeline:
    def __init__(self, pipe: Any, log: SlotLog):
        self._pipe = pipe
        self._log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)

    def __enter__(self) -> SlotPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pipe.reset()

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        self._log.pipeline(list(self._pipe.command_stack))
        return self._pipe.execute(*args, **kwargs)


class SlotClient:
    """A plain client that logs the slots of what it sends (see :class:`SlotLog`)."""

    def __init__(self, client: Any, log: SlotLog):
        self._client = client
        self.log = log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def register_script(self, source: str) -> Script:
        return Script(self, source)

    def evalsha(self, sha: str, numkeys: int, *rest: Any) -> Any:
        self.log.script(sha, list(rest[:numkeys]))
        return self._client.evalsha(sha, numkeys, *rest)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> SlotPipeline:
        return SlotPipeline(self._client.pipeline(transaction, shard_hint), self.log)


def test_pool_names_must_be_safe_in_a_hash_tag():
    assert check_pool("gpu-a.1_x") == "gpu-a.1_x"
    for bad in ("", "a{b", "a}b", "a b", "a:b", "a*", "gpu\n", 3):  # no newline, even last
        with pytest.raises(ValueError, match="invalid pool name"):
            check_pool(bad)  # type: ignore[arg-type]


@pytest.fixture
def listeners():
    yield
    close_listeners()


def test_every_lease_and_pool_script_and_pipeline_keeps_to_one_slot(
    redis_client, prefix, listeners, on_cluster
):
    log = SlotLog()
    # a cluster refuses a script or pipeline across slots by itself: its client runs the store
    client = redis_client if on_cluster else SlotClient(redis_client, log)
    store = LeaseStore(client, prefix)  # type: ignore[arg-type]
    k = store.keys
    assert len(_slots([k.lease("a", "x"), k.lease("b", "x")])) == 2  # two pools, two slots
    for pool in ("a", "b"):
        store.set_pool_ttl(pool, 30_000)
        for n in range(2):
            store.register_gpu(GpuInfo(f"{pool}{n}", pool, f"host-{pool}"))
        store.host_heartbeat(f"host-{pool}", 60_000)
    store.register_gpu(GpuInfo("b1", "a", "host-b"))  # moved: its host is live in both pools
    assert [g.gpu_id for g in store.gpus("a")] == ["a0", "a1", "b1"]

    lease = store.try_claim("a0", "job-1")
    assert lease is not None and lease.pool == "a"
    store.renew(lease)
    store.check_fence("a0", lease.token, "d1", "job-1")
    store.release(lease)
    assert store.restore("a0", "job-1", lease.token)
    assert store.force_release("a0", lease.token)
    later = store.try_claim("a0", "job-2")
    store.record_mark("a0", later.token + 5)
    assert store.unblock("a0", later.token, "job-2")  # fence_lift

    held = store.try_claim("a1", "job-3")
    running = RunningRecord(store, held, "job-3")
    begin(store, held, running)
    assert finish(store, held, "job-3")

    drain(store, ["b0"])
    assert undrain(store, ["b0"]) == {"b0": True}
    waiter = LeaseWaiter(store, recheck_s=0.2)
    got = waiter.acquire("b", "job-4", timeout_s=5)
    assert got.gpu_id == "b0"
    assert not waiter.leave("b", "nobody-waits")
    beat = ProcessBeat(client, k)
    beat.join("b")
    beat.beat()
    beat.close()

    every = PooledRecords(client, k)
    records = every.of("b")
    records.sent("r1", [{}], {"pool": "b"}, 1_000)
    assert records.take("r1", "proc-gone", "d1") == "taken"
    assert records.dead_takers(0) == [("r1", "proc-gone")]
    assert records.requeue("r1", "taken", "proc-gone", 2_000) is not None
    assert records.take("r1", "proc-gone", "d2") == "taken"
    assert records.handoff("r1", "d2", "b0", got.token) == "handed"
    direct = DirectClaims(store, every).claim("r2", [{}], {"pool": "a"}, None)
    assert direct is not None and direct.pool == "a"
    store.table()

    assert log.spread == []
    if not on_cluster:
        assert sorted(set(SCRIPTS) - set(log.calls)) == []  # every script was looked at
