"""The store's Redis Cluster client (store/cluster.py) on a real three-master cluster on loopback
(tests/support/redis_cluster.py), and the ``redis+cluster://`` URL and settings around it.

Pipelines keep to one slot: one round trip to the slot's owner, refused before sending when
they span slots, following MOVED, ASK and TRYAGAIN by sending only what the cluster refused (so
a script runs once), and loading a script on a node that lost it. Round trips are counted by a
real connection that tallies what it sends to each node, its handshake left out.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import pytest
import redis

from gpuhedge_celery.errors import ConfigError, StoreUnavailable
from gpuhedge_celery.redis_url import is_cluster, location, parse_cluster_url, redact_url
from gpuhedge_celery.shared_settings import Settings
from gpuhedge_celery.store.cluster import ClusterClient, CrossSlotPipeline
from gpuhedge_celery.store.connection import (
    client_location,
    database_number,
    persistence_warning,
    ping,
    redis_from_url,
    replication_warning,
    same_database,
)
from gpuhedge_celery.store.scripts import lua_script, queue_script, run_pipeline
from gpuhedge_celery.tasks.app import celery_conf
from gpuhedge_celery.tasks.config import GlueConfig
from tests.support.redis_cluster import LocalCluster
from tests.support.redis_server import free_port

URL = "redis+cluster://app:s3cret@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002/0"
on_cluster = pytest.mark.redis  # a real redis-server, as every store test on one

SENT: Counter[tuple[int, str]] = Counter()  # what the test's clients sent: (node port, what)


class CountingConnection(redis.Connection):
    """A real connection that counts its sends (round trips) per node, not its handshake: a
    pipeline's as "pipeline", a single command's by its name."""

    handshake = False
    single: str | None = None

    def connect_check_health(self, *args, **kwargs):
        self.handshake = True
        try:
            return super().connect_check_health(*args, **kwargs)
        finally:
            self.handshake = False

    def send_command(self, *args, **kwargs):
        self.single = str(args[0]).upper()
        try:
            return super().send_command(*args, **kwargs)
        finally:
            self.single = None

    def send_packed_command(self, command, check_health=True):
        if not self.handshake:
            SENT[(self.port, self.single or "pipeline")] += 1
        return super().send_packed_command(command, check_health)


def counting_client(cluster: LocalCluster) -> ClusterClient:
    client = redis_from_url(cluster.url, decode_responses=True)
    assert isinstance(client, ClusterClient)
    for node in client.get_nodes():  # every node's connections count from here on
        pool = client.get_redis_connection(node).connection_pool
        pool.connection_class = CountingConnection
        pool.reset()
    return client


def tag_on(cluster: LocalCluster, node=None, avoid=None) -> tuple[str, int]:
    """A fresh hash tag (and its slot) owned by ``node``, or by any node but ``avoid``."""
    while True:
        tag = uuid.uuid4().hex[:8]
        slot = cluster.key_slot(f"{{{tag}}}")
        owner = cluster.owner(slot)
        if (node is None or owner is node) and owner is not avoid:
            return tag, slot


def sent_during(action) -> tuple[object, dict[int, int]]:
    """``action()``'s result and its pipelines' round trips per node port; anything else sent
    meanwhile can only be a read of the topology (after a redirect)."""
    SENT.clear()
    result = action()
    assert {what for _, what in SENT} <= {"pipeline", "CLUSTER SLOTS"}, SENT
    return result, {port: n for (port, what), n in SENT.items() if what == "pipeline"}


def waits_on(cluster: LocalCluster, node) -> int:
    with cluster.client(node) as c:
        return int(c.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def topology_reads() -> int:
    return sum(n for (_, what), n in SENT.items() if what == "CLUSTER SLOTS")


# --- URLs and settings (no server) ---


def test_a_cluster_url_names_its_seed_nodes_credentials_and_tls():
    spec = parse_cluster_url(URL)
    assert spec.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002))
    assert (spec.username, spec.password, spec.tls, spec.ssl_ca_certs) == (
        "app", "s3cret", False, None,
    )  # fmt: skip
    tls = parse_cluster_url("rediss+cluster://:p%40ss@h1:7000,h2?ssl_ca_certs=/etc/ca.pem")
    assert tls.nodes == (("h1", 7000), ("h2", 6379)) and tls.password == "p@ss"
    assert tls.username is None and tls.tls and tls.ssl_ca_certs == "/etc/ca.pem"
    assert is_cluster(URL) and is_cluster("REDISS+CLUSTER://h:1") and not is_cluster("redis://h")
    assert Settings(redis_url=URL).redis_url == URL


def test_a_cluster_urls_password_never_shows():
    assert redact_url(URL) == "redis+cluster://app:***@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002/0"
    assert location(URL) == "redis+cluster://10.0.0.1:7000,10.0.0.2:7001,[::1]:7002/0"
    assert location("rediss+cluster://:pw@h:7000") == "rediss+cluster://h:7000/0"
    assert "s3cret" not in repr(Settings(redis_url=URL))
    assert redact_url("redis+cluster://h1:1,h2:2") == "redis+cluster://h1:1,h2:2"


@pytest.mark.parametrize(
    "url, says",
    [
        ("redis+cluster://:s3cret@h1:7000,h2:7001/1", "database 0 only"),
        ("redis+cluster://:s3cret@h1:7000,h2:notaport/0", "bad port"),
        ("redis+cluster://:s3cret@h1:70000/0", "bad port"),
        ("redis+cluster://:s3cret@/0", "names no node"),
        ("redis+cluster://:s3cret@h1:7000,:7001/0", "without a host"),
        ("redis+cluster://:s3cret@h1:7000/0?master=m", "unknown option 'master'"),
        ("redis+cluster://:s3cret@h1:7000/0?ssl_ca_certs=/ca.pem", "rediss+cluster"),
    ],
)
def test_a_bad_cluster_url_is_one_line_naming_the_variable(url, says):
    with pytest.raises(ConfigError, match="GPUHEDGE_REDIS_URL") as info:
        Settings.from_env({"GPUHEDGE_REDIS_URL": url})
    assert says in str(info.value) and "\n" not in str(info.value)
    assert "s3cret" not in str(info.value)


def test_a_cluster_store_needs_a_redis_broker_of_its_own_which_also_keeps_the_results():
    with pytest.raises(ConfigError) as info:
        GlueConfig.from_env({"GPUHEDGE_REDIS_URL": URL})
    message = str(info.value)
    assert "GPUHEDGE_BROKER_URL" in message and "GPUHEDGE_REDIS_URL" in message
    assert "\n" not in message and "s3cret" not in message
    with pytest.raises(ConfigError, match="must then be a Redis") as info:
        GlueConfig.from_env(
            {"GPUHEDGE_REDIS_URL": URL, "GPUHEDGE_BROKER_URL": "amqp://u:rabb1t@mq:5672//"}
        )
    assert "rabb1t" not in str(info.value) and "s3cret" not in str(info.value)
    broker = "redis://:brok3r@10.0.0.9:6379/3"
    config = GlueConfig.from_env({"GPUHEDGE_REDIS_URL": URL, "GPUHEDGE_BROKER_URL": broker})
    conf = celery_conf(config)
    assert conf["broker_url"] == conf["result_backend"] == broker
    # a plain store keeps the results itself, whatever the broker
    plain = GlueConfig.from_env(
        {"GPUHEDGE_REDIS_URL": "redis://store:6379/0", "GPUHEDGE_BROKER_URL": broker}
    )
    assert celery_conf(plain)["result_backend"] == "redis://store:6379/0"


def test_a_cluster_nobody_answers_is_one_line_without_its_password():
    url = f"redis+cluster://:s3cret@127.0.0.1:{free_port()},127.0.0.1:{free_port()}/0"
    with pytest.raises(redis.ConnectionError):
        redis_from_url(url, socket_connect_timeout=1)
    with pytest.raises(StoreUnavailable) as info:
        ping(url)
    assert "unreachable" in str(info.value) and "s3cret" not in str(info.value)
    assert "\n" not in str(info.value)


# --- on a real cluster ---


@on_cluster
def test_the_client_says_where_it_connects_without_the_password(redis_cluster):
    client = redis_from_url(redis_cluster.url, decode_responses=True)
    assert client_location(client) == location(redis_cluster.url)
    assert redis_cluster.password not in client_location(client) + repr(client)
    assert database_number(client) == 0
    other = redis_from_url(redis_cluster.url)
    assert same_database(client, other)
    assert not same_database(client, redis.Redis(*redis_cluster.nodes[0].address))
    assert client.ping() and client.set("{x}plain", "1") and client.get("{x}plain") == "1"


@on_cluster
@pytest.mark.parametrize("transaction", [False, True])
def test_a_pipeline_of_scripts_and_hash_commands_of_one_slot_is_one_round_trip_on_its_owner(
    redis_cluster, transaction
):
    client = counting_client(redis_cluster)
    owner = redis_cluster.nodes[1]
    tag, _ = tag_on(redis_cluster, node=owner)
    lease, fence, info = f"{{{tag}}}:lease", f"{{{tag}}}:fence", f"{{{tag}}}:info"
    fence_lift = lua_script(client, "fence_lift")
    client.script_load(fence_lift.script)  # on every primary: no NOSCRIPT below

    def build(pipe):
        queue_script(pipe, fence_lift, [lease, fence], ["5", "", "7"])
        pipe.hset(info, mapping={"a": "1", "b": "2"})
        pipe.pexpire(info, 60_000)
        pipe.hgetall(info)
        pipe.publish(f"chan-{tag}", "wake")  # keyless: with the others
        pipe.time()
        pipe.execute_command("WAIT", 0, 100)

    replies, sent = sent_during(lambda: run_pipeline(client, build, [fence_lift]))
    assert sent == {owner.port: 1} and topology_reads() == 0
    assert replies[0] == [0, "7"] and replies[1] == 2 and replies[2] is True
    assert replies[3] == {"a": "1", "b": "2"}  # redis-py's reply callbacks ran
    assert isinstance(replies[5], tuple) and replies[6] == 0
    with redis_cluster.client(owner) as node:
        assert node.get(fence) == "7" and node.hget(info, "b") == "2"
    pipe = client.pipeline(transaction=transaction)
    pipe.hincrby(info, "a", 1).hget(info, "a")
    assert sent_during(pipe.execute) == ([2, "2"], {owner.port: 1})


@on_cluster
def test_a_pipeline_spanning_slots_is_refused_before_anything_is_sent(redis_cluster):
    client = counting_client(redis_cluster)
    one, slot_one = tag_on(redis_cluster, node=redis_cluster.nodes[0])
    two, slot_two = tag_on(redis_cluster, node=redis_cluster.nodes[0])  # same node, other slot
    pipe = client.pipeline(transaction=False)
    pipe.set(f"{{{one}}}:a", 1).publish("anything", "x").set(f"{{{two}}}:b", 2)
    SENT.clear()
    with pytest.raises(CrossSlotPipeline) as info:
        pipe.execute()
    message = str(info.value)
    assert f"{{{one}}}:a" in message and f"{{{two}}}:b" in message
    assert f"slot {slot_one}" in message and f"slot {slot_two}" in message
    assert not SENT
    assert client.exists(f"{{{one}}}:a") == client.exists(f"{{{two}}}:b") == 0
    # a script's keys are read from its numkeys: one spanning slots is refused the same way
    fence_lift = lua_script(client, "fence_lift")
    SENT.clear()
    with pytest.raises(CrossSlotPipeline):
        run_pipeline(
            client,
            lambda p: queue_script(p, fence_lift, [f"{{{one}}}:l", f"{{{two}}}:f"], ["1", "", "2"]),
        )
    assert not SENT


@on_cluster
@pytest.mark.parametrize("transaction", [False, True])
def test_a_slot_moved_mid_use_is_followed_and_its_commands_run_once(redis_cluster, transaction):
    client = counting_client(redis_cluster)
    tag, slot = tag_on(redis_cluster)
    counter, fence = f"{{{tag}}}:n", f"{{{tag}}}:fence"
    fence_lift = lua_script(client, "fence_lift")
    client.script_load(fence_lift.script)

    def build(pipe):
        pipe.incr(counter)
        queue_script(pipe, fence_lift, [f"{{{tag}}}:lease", fence], ["1", "", "9"])
        pipe.execute_command("WAIT", 0, 50)

    def run():
        pipe = client.pipeline(transaction=transaction)
        build(pipe)
        return pipe.execute()

    assert run()[:2] == [1, [0, "9"]]
    old = redis_cluster.owner(slot)
    new = redis_cluster.other_than(old)
    redis_cluster.move_slot(slot, new)  # the client still thinks the slot is old's
    replies, sent = sent_during(run)
    assert replies[:2] == [2, [0, "9"]] and replies[2] == 0
    assert sent == {old.port: 1, new.port: 1}  # refused by the old owner, run by the new
    assert topology_reads() == 0  # the MOVED named the new owner
    with redis_cluster.client(new) as node:
        assert node.get(counter) == "2"
    # the MOVED corrected the client's slot table: the next pipeline goes straight there
    assert sent_during(run)[1] == {new.port: 1}
    assert topology_reads() == 0


@on_cluster
def test_during_a_migration_only_the_commands_a_node_refused_are_sent_again(redis_cluster):
    client = counting_client(redis_cluster)
    tag, slot = tag_on(redis_cluster)
    here, gone, new = f"{{{tag}}}:here", f"{{{tag}}}:gone", f"{{{tag}}}:new"
    client.set(here, 1)
    client.set(gone, 1)
    source = redis_cluster.owner(slot)
    target = redis_cluster.other_than(source)
    redis_cluster.begin_migration(slot, target)
    try:
        redis_cluster.migrate_keys(slot, source, target, [gone])
        pipe = client.pipeline(transaction=False)
        pipe.incr(here).incr(gone).incr(new).execute_command("WAIT", 0, 50)
        waits = waits_on(redis_cluster, target)
        replies, sent = sent_during(pipe.execute)
        assert waits_on(redis_cluster, target) == waits + 1  # the WAIT followed the writes
        # here ran on the source; gone and new were sent on, with ASKING, to the target
        assert replies == [2, 2, 1, 0]
        assert sent == {source.port: 1, target.port: 1} and topology_reads() == 0
        assert redis_cluster.held(source, slot) == {here: "2"}
        assert redis_cluster.held(target, slot) == {gone: "2", new: "1"}

        # a script whose keys the migration split is refused (TRYAGAIN) until it is done
        fence_lift = lua_script(client, "fence_lift")
        client.script_load(fence_lift.script)

        def finish():
            time.sleep(0.3)
            redis_cluster.migrate_keys(slot, source, target)
            redis_cluster.finish_migration(slot, target)

        finishing = threading.Thread(target=finish)
        finishing.start()
        replies = run_pipeline(
            client, lambda p: queue_script(p, fence_lift, [gone, here], ["1", "", "5"])
        )
        finishing.join()
        assert replies == [[0, "5"]]
    finally:
        if redis_cluster.owner(slot) is not target:
            redis_cluster.migrate_keys(slot, source, target)
            redis_cluster.finish_migration(slot, target)
    assert client.get(here) == "5" and client.get(gone) == "2" and client.get(new) == "1"


@on_cluster
@pytest.mark.parametrize("raise_on_error", [False, True])
def test_a_script_a_node_never_saw_is_loaded_there_and_the_pipeline_sent_again(
    redis_cluster, raise_on_error
):
    client = counting_client(redis_cluster)
    node = redis_cluster.nodes[2]
    tag, _ = tag_on(redis_cluster, node=node)
    fence_lift = lua_script(client, "fence_lift")
    with redis_cluster.client(node) as c:
        c.script_flush()
        assert c.script_exists(fence_lift.sha) == [False]
    build = lambda p: queue_script(p, fence_lift, [f"{{{tag}}}:l", f"{{{tag}}}:f"], ["1", "", "3"])  # noqa: E731
    replies = run_pipeline(client, build, [fence_lift], raise_on_error=raise_on_error)
    assert replies == [[0, "3"]]
    with redis_cluster.client(node) as c:
        assert c.script_exists(fence_lift.sha) == [True] and c.get(f"{{{tag}}}:f") == "3"


@on_cluster
def test_script_calls_and_single_commands_go_to_the_node_of_their_key(redis_cluster):
    client = redis_from_url(redis_cluster.url, decode_responses=True)
    fence_lift = lua_script(client, "fence_lift")
    for i, node in enumerate(redis_cluster.nodes):
        with redis_cluster.client(node) as c:
            c.script_flush()  # the first call on each node meets NOSCRIPT
        tag, slot = tag_on(redis_cluster, node=node)
        fence, mark = f"{{{tag}}}:f", str(10 + i)
        assert fence_lift(keys=[f"{{{tag}}}:l", fence], args=["1", "", mark]) == [0, mark]
        for other in redis_cluster.nodes:
            assert redis_cluster.held(other, slot) == ({fence: mark} if other is node else {})
        assert client.get(fence) == mark


@on_cluster
def test_a_watched_transaction_keeps_to_the_watched_slot(redis_cluster):
    client = redis_from_url(redis_cluster.url, decode_responses=True)
    tag, _ = tag_on(redis_cluster)
    other, _ = tag_on(redis_cluster)
    key = f"{{{tag}}}:ledger"
    client.set(key, 1)
    with client.pipeline() as pipe:
        pipe.watch(key)
        value = int(pipe.get(key))
        pipe.multi()
        pipe.set(key, value + 1).get(key)
        assert pipe.execute() == [True, "2"]
    with client.pipeline() as pipe:
        pipe.watch(key)
        client.set(key, 10)  # another writer: the transaction must not apply
        pipe.multi()
        pipe.set(key, 3)
        with pytest.raises(redis.WatchError):
            pipe.execute()
    assert client.get(key) == "10"
    with client.pipeline() as pipe:
        pipe.watch(key)
        with pytest.raises(CrossSlotPipeline, match="watching slot"):
            pipe.get(f"{{{other}}}:x")


@on_cluster
def test_a_tls_cluster_is_reached_through_its_rediss_cluster_url():
    with LocalCluster(tls=True) as cluster:
        assert cluster.url.startswith("rediss+cluster://")
        client = redis_from_url(cluster.url, decode_responses=True)
        assert client_location(client).startswith("rediss+cluster://127.0.0.1:")
        tag, _ = tag_on(cluster, node=cluster.nodes[2])
        pipe = client.pipeline(transaction=False)
        pipe.set(f"{{{tag}}}:a", "tls").get(f"{{{tag}}}:a")
        assert pipe.execute() == [True, "tls"]
        with cluster.client(cluster.nodes[2]) as node:
            assert node.get(f"{{{tag}}}:a") == "tls"
        client.close()


def test_the_start_up_warnings_judge_every_primary_not_one_node():
    with LocalCluster(replicas=True) as cluster:
        client = redis_from_url(cluster.url, decode_responses=True)
        primaries = cluster.primaries()
        said = persistence_warning(client)
        assert said is not None and "(and 2 more primaries) keeps no persistence at all" in said
        for node in primaries[:2]:
            with cluster.client(node) as c:
                c.config_set("appendonly", "yes")
        # only the third primary is without AOF now: the warning names it
        assert f"Redis 127.0.0.1:{primaries[2].port} keeps" in persistence_warning(client)
        with cluster.client(primaries[2]) as c:
            c.config_set("appendonly", "yes")
        assert persistence_warning(client) is None
        said = replication_warning(client, 0)
        assert said is not None and "has 1 replicas and GPUHEDGE_REDIS_WAIT_REPLICAS is 0" in said
        assert replication_warning(client, 1) is None
        client.close()


class _Nodes:
    """What ``CLUSTER NODES`` says, as redis-py parses it (a stand-in for the cluster)."""

    def __init__(self, nodes: dict):
        self.nodes = nodes

    def cluster_nodes(self) -> dict:
        return self.nodes


def _node(flags: str, slots=(("0", "100"),), hostname: str = "") -> dict:
    return {"flags": flags, "slots": [list(s) for s in slots], "hostname": hostname}


@pytest.mark.parametrize(
    ("nodes", "known", "missing"),
    [
        ({"10.0.0.1:7000": _node("master")}, {"10.0.0.1:7000"}, []),
        ({"10.0.0.2:7001": _node("master")}, {"10.0.0.1:7000"}, ["10.0.0.2:7001"]),
        # announced by hostname: the client names it so
        ({"10.0.0.1:7000": _node("master", hostname="vm")}, {"vm:7000"}, []),
        # a lone node that never learned its own address
        ({":7000": _node("myself,master")}, {"127.0.0.1:7000"}, []),
        # a master that may not fail over is still a master ("fail" is a flag, not a substring)
        ({"10.0.0.2:7001": _node("master,nofailover")}, {"10.0.0.1:7000"}, ["10.0.0.2:7001"]),
        # failed, suspected, joining, slotless or a replica: nothing to listen to
        ({"10.0.0.2:7001": _node("master,fail")}, set(), []),
        ({"10.0.0.2:7001": _node("master,fail?")}, set(), []),
        ({"10.0.0.2:7001": _node("master,handshake")}, set(), []),
        ({"10.0.0.2:7001": _node("master", slots=())}, set(), []),
        ({"10.0.0.2:7001": _node("slave")}, set(), []),
    ],
)
def test_the_primaries_a_listener_misses_are_named_by_address_or_hostname(nodes, known, missing):
    client = ClusterClient(_Nodes(nodes), parse_cluster_url("redis+cluster://10.0.0.1:7000/0"))
    assert client.primaries_not_in(frozenset(known)) == missing
