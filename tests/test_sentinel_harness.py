"""The Redis failover harness (tests/support/sentinel.py): a primary, two replicas and three
Sentinels on loopback that fail over on demand, with or without losing acknowledged writes.

Durations are printed as JSON lines (``pytest -s`` shows them); docs/benchmarks.md, "Failover
harness", records them.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.parse

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from tests.support.faults import wait_until
from tests.support.sentinel import SentinelGroup


@pytest.fixture(scope="module")
def group():
    """One group for the tests that fail nothing over."""
    with SentinelGroup() as g:
        yield g


@pytest.fixture
def own_group():
    with SentinelGroup() as g:
        yield g


def _url_sentinels(url: str) -> tuple[list[tuple[str, int]], str, str]:
    """The Sentinels' addresses, the password and the master name a ``sentinel://`` URL names."""
    parts = [urllib.parse.urlsplit(p) for p in url.split(";")]
    passwords = {p.password for p in parts}
    assert len(passwords) == 1, url
    master = urllib.parse.parse_qs(parts[-1].query)["master"]
    assert parts[-1].path == "/0"
    return [(str(p.hostname), int(p.port or 0)) for p in parts], str(passwords.pop()), master[0]


def _discover(g: SentinelGroup) -> Sentinel:
    addresses, password, _ = _url_sentinels(g.url)
    return Sentinel(
        addresses,
        sentinel_kwargs={"password": g.sentinel_password, "socket_timeout": 1},
        password=password,
        socket_timeout=1,
    )


def _settled_like_the_harness_says(g: SentinelGroup, old, new) -> None:
    assert new != old
    assert g.primary() == new
    assert _discover(g).discover_master(g.master_name) == new
    with g.client_for_primary() as c:
        assert c.execute_command("ROLE")[0] == b"master"
    assert g.node(old).replicates(new)
    assert g.replicas() == sorted(n.address for n in g.nodes if n.address != new)


def test_the_urls_sentinels_name_the_primary_with_their_password(group):
    addresses, password, master = _url_sentinels(group.url)
    assert addresses == group.sentinel_addresses and len(set(addresses)) == 3
    assert all(host == "127.0.0.1" for host, _ in addresses)
    assert password == group.password and master == group.master_name == "mymaster"
    assert group.sentinel_password and group.sentinel_password != group.password

    found = _discover(group).discover_master("mymaster")
    assert found == group.primary() == group.nodes[0].address
    assert [s.primary() for s in group.sentinels] == [found] * 3
    with _discover(group).master_for("mymaster", socket_timeout=1) as client:
        assert client.ping()
    # and neither the Sentinels nor the data nodes answer without their passwords
    with pytest.raises(MasterNotFoundError):
        no_retry = {"socket_timeout": 1, "retry": Retry(NoBackoff(), 0)}
        Sentinel(addresses, sentinel_kwargs=no_retry).discover_master("mymaster")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(*found, socket_timeout=1, retry=Retry(NoBackoff(), 0)).ping()


def test_every_data_node_has_aof_keyspace_events_and_the_password(group):
    for node in group.nodes:
        with node.poll_client() as c:
            config = c.config_get("*")
        assert config["appendonly"] == "yes" and config["appendfsync"] == "everysec"
        assert set(config["notify-keyspace-events"]) == set("Egx")
        assert config["requirepass"] == config["masterauth"] == group.password
    for sentinel in group.sentinels:
        state = sentinel.master_state()
        assert state is not None and state["flags"] == "master"
        assert state["quorum"] == "2" and state["parallel-syncs"] == "1"
        assert state["down-after-milliseconds"] == "1000" and state["failover-timeout"] == "3000"
        assert state["num-slaves"] == "2" and state["num-other-sentinels"] == "2"


def test_a_write_on_the_primary_reaches_both_replicas(group):
    replicas = group.replicas()
    assert len(replicas) == 2 and group.primary() not in replicas
    with group.client_for_primary() as c:
        c.set("harness:reaches", "both")
    for address in replicas:
        with group.node(address).poll_client() as c:
            wait_until(lambda c=c: c.get("harness:reaches") == "both", 5, what="replication")


@pytest.mark.slow
def test_three_failovers_in_a_row_each_change_the_primary_and_keep_replicated_data(own_group):
    g = own_group
    durations = []
    written = []
    primaries = [g.primary()]
    for i in range(3):
        with g.client_for_primary() as c:
            c.set(f"harness:before{i}", i)
            assert c.wait(2, 2000) == 2  # on both replicas before the failover
        written.append(f"harness:before{i}")
        began = time.monotonic()
        old, new = g.failover()
        durations.append(time.monotonic() - began)
        assert old == primaries[-1]
        _settled_like_the_harness_says(g, old, new)
        primaries.append(new)
        for node in g.nodes:
            with node.poll_client() as c:
                wait_until(lambda c=c: c.exists(*written) == len(written), 5, what="old data")
    print(json.dumps({"harness": "failover", "s": [round(d, 2) for d in durations]}))


@pytest.mark.slow
def test_a_lossy_failover_loses_exactly_the_unreplicated_write(own_group):
    g = own_group
    durations = []
    for i in range(3):
        with g.client_for_primary() as c:
            c.set(f"harness:kept{i}", "yes")
            assert c.wait(2, 2000) == 2

        def write(client: redis.Redis, i: int = i) -> None:
            assert client.info("replication")["connected_slaves"] == 0
            assert client.set(f"harness:lost{i}", "acknowledged by the old primary only")
            assert client.get(f"harness:lost{i}") is not None

        began = time.monotonic()
        old, new = g.lossy_failover(write)
        durations.append(time.monotonic() - began)
        _settled_like_the_harness_says(g, old, new)
        for node in g.nodes:  # the old primary resynced: nobody has the write any more
            with node.poll_client() as c:
                assert c.get(f"harness:lost{i}") is None, node.name
                assert c.exists(*[f"harness:kept{k}" for k in range(i + 1)]) == i + 1, node.name
                assert c.config_get("masterauth")["masterauth"] == g.password
        # and the group replicates again afterwards
        with g.client_for_primary() as c:
            c.set(f"harness:after{i}", "yes")
            assert c.wait(2, 2000) == 2
    print(json.dumps({"harness": "lossy_failover", "s": [round(d, 2) for d in durations]}))


@pytest.mark.slow
def test_a_killed_primary_is_replaced_and_comes_back_as_a_replica(own_group):
    g = own_group
    with g.client_for_primary() as c:
        c.set("harness:survives", "yes")
        assert c.wait(2, 2000) == 2
    began = time.monotonic()
    old, new = g.kill_primary()
    killed_s = time.monotonic() - began
    assert new != old and not g.node(old).running
    assert _discover(g).discover_master("mymaster") == new
    with g.client_for_primary(decode_responses=True) as c:
        assert c.get("harness:survives") == "yes"
    began = time.monotonic()
    g.restart(old)
    restart_s = time.monotonic() - began
    assert g.node(old).replicates(new)
    old2, new2 = g.failover()  # a restarted node takes part again
    assert old2 == new and new2 != new
    replica = g.node(g.replicas()[0])  # a replica killed by hand comes back in sync too
    replica.kill()
    with g.client_for_primary(decode_responses=True) as c:
        c.set("harness:while_down", "yes")
    g.restart(replica)
    with replica.poll_client() as c:
        assert c.get("harness:while_down") == "yes"
    timings = {"s": round(killed_s, 2), "restart_s": round(restart_s, 2)}
    print(json.dumps({"harness": "kill_primary", **timings}))


def test_close_stops_every_process_and_removes_its_files():
    g = SentinelGroup()
    processes = g.processes
    ports = [n.port for n in g.nodes] + [s.port for s in g.sentinels]
    assert len(processes) == 6 and all(p.poll() is None for p in processes)
    assert os.path.isdir(g.workdir)
    began = time.monotonic()
    g.close()
    closed_s = time.monotonic() - began
    assert all(p.poll() is not None for p in processes)
    assert not any(os.path.exists(f"/proc/{p.pid}") for p in processes)
    for port in ports:
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            pass
    assert not os.path.exists(g.workdir)
    g.close()  # twice is harmless
    print(json.dumps({"harness": "close", "s": round(closed_s, 2)}))
