"""A real Redis Cluster on loopback for tests: three masters (optionally a replica each) on free
ports, with a password, optionally TLS only, and helpers that move a hash slot between nodes the
way ``redis-cli --cluster reshard`` does (``CLUSTER SETSLOT IMPORTING/MIGRATING``, ``MIGRATE``,
``CLUSTER SETSLOT NODE``), in one go or a step at a time, add a master, and fail a master over
to its replica (``CLUSTER FAILOVER``).

Started without ``redis-cli``: each node gets a config epoch and a third of the slots
(``CLUSTER ADDSLOTSRANGE``), the first meets the others (``CLUSTER MEET``), and :meth:`start`
returns once every node says ``cluster_state:ok`` and all agree on which node owns which slot.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.support.processes import stop_process
from tests.support.redis_server import free_port

SLOTS = 16384
START_S = 20.0


@dataclass
class ClusterNodeProcess:
    """One redis-server of the cluster."""

    port: int
    bus_port: int
    workdir: str
    process: subprocess.Popen | None = None
    node_id: str = ""

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.port


@dataclass
class LocalCluster:
    """``masters`` redis-servers in cluster mode; :attr:`url` is their ``redis+cluster://`` URL
    (``rediss+cluster://`` with ``tls``, trusting the certificate generated here)."""

    masters: int = 3
    password: str = "clu5ter-pw"
    tls: bool = False
    replicas: bool = False  # a replica per master, for failovers
    node_timeout_ms: int = 5000  # how long a master may be unreachable before it counts as failed
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="gpuhedge-cluster-"))
    nodes: list[ClusterNodeProcess] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[: self.masters])
        if self.tls:
            return f"rediss+cluster://:{self.password}@{hosts}/0?ssl_ca_certs={self._cert()}"
        return f"redis+cluster://:{self.password}@{hosts}/0"

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalCluster:
        """Start the nodes and join them; RuntimeError (naming what is missing) otherwise."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/test.sh installs it)")
        try:
            for _ in range(self.masters * (2 if self.replicas else 1)):
                self.nodes.append(self._spawn(binary))
            self._join()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, binary: str) -> ClusterNodeProcess:
        node = ClusterNodeProcess(
            free_port(), free_port(), os.path.join(self.workdir, str(len(self.nodes)))
        )
        os.makedirs(node.workdir)
        node.process = subprocess.Popen(
            [binary, *self._args(node)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        return node

    def _wait_id(self, node: ClusterNodeProcess, deadline: float) -> None:
        while True:
            try:
                with self.client(node) as c:
                    node.node_id = c.execute_command("CLUSTER MYID")
                return
            except redis.RedisError as e:
                if node.process is not None and node.process.poll() is not None:
                    raise RuntimeError(f"redis-server on port {node.port} exited") from e
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {node.port} did not start") from e
                time.sleep(0.05)

    def add_master(self) -> ClusterNodeProcess:
        """Start one more node and join it as a master without slots (move some to it)."""
        node = self._spawn(shutil.which("redis-server") or "redis-server")
        self.nodes.append(node)
        self._wait_id(node, time.monotonic() + START_S)
        with self.client(self.nodes[0]) as c:
            c.execute_command("CLUSTER MEET", "127.0.0.1", node.port, node.bus_port)
        self._wait_known()
        self.wait_agreed()
        return node

    def _wait_known(self) -> None:
        """Until every live node lists every live node (a master without slots shows in no
        slot map, and a slot may be given only to a node every node knows)."""
        deadline = time.monotonic() + START_S
        live = self._live()
        ids = {n.node_id for n in live}
        while True:
            try:
                if all(self._known_ids(n) >= ids for n in live):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the nodes did not all meet the new one")
            time.sleep(0.05)

    def _known_ids(self, node: ClusterNodeProcess) -> set[str]:
        with self.client(node) as c:
            found = c.execute_command("CLUSTER NODES")
        if isinstance(found, dict):
            return {info["node_id"] for info in found.values()}
        return {line.split()[0] for line in str(found).splitlines() if line.strip()}

    def replica_of(self, master: ClusterNodeProcess) -> ClusterNodeProcess:
        """The node that replicates ``master``."""
        with self.client(master) as c:
            replica = c.info("replication")["slave0"]
        return next(n for n in self.nodes if n.port == int(replica["port"]))

    def failover(self, master: ClusterNodeProcess) -> ClusterNodeProcess:
        """Promote ``master``'s replica (``CLUSTER FAILOVER``: the replica catches up first, so
        no write is lost) and wait until every node agrees; returns the new master."""
        replica = self.replica_of(master)
        with self.client(replica) as c:
            c.execute_command("CLUSTER FAILOVER")
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            with self.client(replica) as c:
                if c.execute_command("ROLE")[0] == "master":
                    break
            time.sleep(0.05)
        self.wait_agreed()
        return replica

    def primaries(self) -> list[ClusterNodeProcess]:
        """The nodes that own slots now."""
        owners = {node_id for _, _, node_id in self.slot_map(self._live()[0])}
        return [n for n in self.nodes if n.node_id in owners]

    def _live(self) -> list[ClusterNodeProcess]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def kill(self, master: ClusterNodeProcess) -> ClusterNodeProcess:
        """SIGKILL ``master`` and wait until its replica has taken over (once the others count
        it failed: ``node_timeout_ms``) and the live nodes agree; returns the new master."""
        replica = self.replica_of(master)
        assert master.process is not None
        master.process.kill()
        master.process.wait(10)
        deadline = time.monotonic() + START_S + self.node_timeout_ms / 1000
        while True:
            try:
                with self.client(replica) as c:
                    if c.execute_command("ROLE")[0] == "master":
                        break
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica on port {replica.port} never took over")
            time.sleep(0.05)
        self.wait_agreed()
        return replica

    def restart(self, node: ClusterNodeProcess) -> None:
        """Start a stopped node again from its own config (a failed-over master rejoins as a
        replica of the node that took over), and wait until it has synced."""
        node.process = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", *self._args(node)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_S
        self._wait_id(node, deadline)
        while True:
            try:
                with self.client(node) as c:
                    info = c.info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") == "up":
                    break
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node on port {node.port} did not rejoin as a replica")
            time.sleep(0.05)
        self.wait_agreed()

    def _args(self, node: ClusterNodeProcess) -> list[str]:
        args = [
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-port", str(node.bus_port),
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--requirepass", self.password,
            "--masterauth", self.password,
            "--save", "",
            "--appendonly", "no",
            "--dir", node.workdir,
        ]  # fmt: skip
        if not self.tls:
            return [*args, "--port", str(node.port)]
        cert = self._cert()
        key = str(Path(cert).with_suffix(".key"))
        return [
            *args,
            "--port", "0",
            "--tls-port", str(node.port),
            "--tls-cluster", "yes",
            "--tls-cert-file", cert,
            "--tls-key-file", key,
            "--tls-ca-cert-file", cert,
            "--tls-auth-clients", "no",
        ]  # fmt: skip

    def _cert(self) -> str:
        from tests.support.certs import self_signed

        cert = os.path.join(self.workdir, "tls", "redis.pem")
        if not os.path.exists(cert):
            self_signed(Path(self.workdir) / "tls", "redis", loopback=True)
        return cert

    def client(self, node: ClusterNodeProcess) -> redis.Redis:
        """A plain client of one node (what the node itself says, no redirects followed)."""
        tls = {"ssl": True, "ssl_ca_certs": self._cert()} if self.tls else {}
        return redis.Redis(
            *node.address, password=self.password, decode_responses=True,
            socket_timeout=5, socket_connect_timeout=2, **tls,
        )  # fmt: skip

    def _join(self) -> None:
        deadline = time.monotonic() + START_S
        for node in self.nodes:
            self._wait_id(node, deadline)
        share = SLOTS // self.masters
        masters, replicas = self.nodes[: self.masters], self.nodes[self.masters :]
        for i, node in enumerate(masters):
            last = SLOTS - 1 if i == self.masters - 1 else (i + 1) * share - 1
            with self.client(node) as c:
                c.execute_command("CLUSTER SET-CONFIG-EPOCH", i + 1)
                c.execute_command("CLUSTER ADDSLOTSRANGE", i * share, last)
        with self.client(self.nodes[0]) as c:
            for node in self.nodes[1:]:
                c.execute_command("CLUSTER MEET", "127.0.0.1", node.port, node.bus_port)
        self.wait_agreed(deadline - time.monotonic())
        for master, replica in zip(masters, replicas, strict=False):
            while True:  # a replica must know its master before it may follow it
                try:
                    with self.client(replica) as c:
                        c.execute_command("CLUSTER REPLICATE", master.node_id)
                    break
                except redis.ResponseError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        if replicas:
            self._wait_replicated(deadline)

    def _wait_replicated(self, deadline: float) -> None:
        for replica in self.nodes[self.masters :]:
            while True:
                with self.client(replica) as c:
                    info = c.info("replication")
                if info.get("master_link_status") == "up":
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replica on port {replica.port} did not sync")
                time.sleep(0.05)

    def slot_map(self, node: ClusterNodeProcess) -> list[tuple[int, int, str]]:
        """(first slot, last slot, owner's node id) as ``node`` sees them, sorted."""
        with self.client(node) as c:
            ranges = c.execute_command("CLUSTER SHARDS")
        found = []
        for shard in ranges:
            shard = dict(zip(shard[::2], shard[1::2], strict=True))
            primary = [dict(zip(n[::2], n[1::2], strict=True)) for n in shard["nodes"]]
            owner = next(n["id"] for n in primary if n["role"] == "master")
            slots = shard["slots"]
            found += [(slots[i], slots[i + 1], owner) for i in range(0, len(slots), 2)]
        return sorted(found)

    def wait_agreed(self, timeout_s: float = START_S) -> None:
        """Until every node says ``cluster_state:ok`` and all see the same owner of each slot."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                states = []
                live = self._live()
                for node in live:
                    with self.client(node) as c:
                        states.append(c.execute_command("CLUSTER INFO"))
                maps = [self.slot_map(n) for n in live]
                ok = all(s.get("cluster_state") == "ok" for s in states)
                if ok and all(m == maps[0] for m in maps):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not agree within {timeout_s:.0f} s")
            time.sleep(0.05)

    def owner(self, slot: int) -> ClusterNodeProcess:
        """The node that owns ``slot`` (as the first live node sees it)."""
        for first, last, node_id in self.slot_map(self._live()[0]):
            if first <= slot <= last:
                return self._by_id(node_id)
        raise LookupError(f"no node owns slot {slot}")

    def held(self, node: ClusterNodeProcess, slot: int) -> dict[str, str | None]:
        """The keys of ``slot`` that ``node`` itself holds, with their string values (read
        after ASKING, so that a node importing the slot answers too)."""
        with self.client(node) as c:
            keys = c.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000)
            found = {}
            for key in keys:
                pipe = c.pipeline(transaction=False)
                pipe.execute_command("ASKING").get(key)
                found[key] = pipe.execute()[1]
        return found

    def key_slot(self, key: str) -> int:
        with self.client(self.nodes[0]) as c:
            return int(c.execute_command("CLUSTER KEYSLOT", key))

    def other_than(self, node: ClusterNodeProcess) -> ClusterNodeProcess:
        return next(n for n in self.nodes if n is not node)

    def _by_id(self, node_id: str) -> ClusterNodeProcess:
        return next(n for n in self.nodes if n.node_id == node_id)

    def begin_migration(self, slot: int, target: ClusterNodeProcess) -> ClusterNodeProcess:
        """Mark ``slot`` importing on ``target`` and migrating on its owner; returns the owner.
        Until :meth:`finish_migration`, the owner answers ASK for keys it no longer holds."""
        source = self.owner(slot)
        with self.client(target) as c:
            c.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source.node_id)
        with self.client(source) as c:
            c.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target.node_id)
        return source

    def migrate_keys(
        self, slot: int, source: ClusterNodeProcess, target: ClusterNodeProcess,
        keys: list[str] | None = None,
    ) -> list[str]:  # fmt: skip
        """MIGRATE ``keys`` (default: every key of ``slot`` on ``source``) to ``target``."""
        with self.client(source) as c:
            if keys is None:
                keys = c.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000)
            if keys:
                c.execute_command(
                    "MIGRATE", "127.0.0.1", target.port, "", 0, 5000,
                    "AUTH", self.password, "KEYS", *keys,
                )  # fmt: skip
        return list(keys or [])

    def finish_migration(self, slot: int, target: ClusterNodeProcess) -> None:
        """Give ``slot`` to ``target`` on every node (the target first, as the docs ask), and
        wait until all agree."""
        for node in sorted(self.nodes, key=lambda n: n is not target):
            with self.client(node) as c:
                c.execute_command("CLUSTER SETSLOT", slot, "NODE", target.node_id)
        self.wait_agreed()

    def move_slot(self, slot: int, target: ClusterNodeProcess) -> ClusterNodeProcess:
        """Move ``slot`` and its keys to ``target`` in one go; returns the former owner."""
        source = self.begin_migration(slot, target)
        self.migrate_keys(slot, source, target)
        self.finish_migration(slot, target)
        return source

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None:
                stop_process(node.process, grace_s=5)
        shutil.rmtree(self.workdir, ignore_errors=True)
