"""Redis failover on one machine: a primary, two replicas and three Sentinels on loopback.

:class:`SentinelGroup` starts them (AOF ``everysec``, keyspace events ``Egx``, a password on
every data node and one on the Sentinels), hands out a ``sentinel://`` URL, and fails the
primary over on demand: cleanly (:meth:`SentinelGroup.failover`), losing writes that only the
old primary acknowledged (:meth:`SentinelGroup.lossy_failover`), or by ``kill -9``
(:meth:`SentinelGroup.kill_primary`). Each returns (old, new) once every running Sentinel names
the new primary however it is asked and has finished the failover, the new primary answers
``ROLE`` as a master, and every other running data node is its connected replica.

The Sentinels' internal periods are shortened with ``SENTINEL DEBUG`` (the knob Redis's own
Sentinel tests use): clients see the same protocol, only sooner. docs/benchmarks.md, "Failover
harness", has the timings.
"""

from __future__ import annotations

import atexit
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support.faults import wait_until
from tests.support.processes import stop_process
from tests.support.redis_server import free_port

HOST = "127.0.0.1"
MASTER_NAME = "mymaster"
Address = tuple[str, int]
_OWN: Any = object()  # sentinel_password's default: a password of the Sentinels' own

# SENTINEL DEBUG periods (ms), shorter than Redis's but long enough that a Sentinel still trusts
# a replica's INFO (read only once a second during a failover, fixed in Redis) when it picks one
# to promote, and hears the new configuration before it would demote the promoted replica (after
# 4 hello periods); docs/benchmarks.md, "Failover harness", says what shorter ones broke.
SENTINEL_DEBUG = {
    "info-period": 500,
    "ping-period": 400,
    "publish-period": 1000,
    "ask-period": 100,
    "min-link-reconnect-period": 500,
    "election-timeout": 2000,
}


# The down-after of the group the suite's [sentinel] modules share (tests/conftest.py): they
# never fail it over, and on a loaded machine a pause past 1 s must not fail it over for them.
SHARED_DOWN_AFTER_MS = 10_000


def _polling_client(port: int, password: str | None) -> redis.Redis:
    """A client for the harness's own polls: short timeouts and no retries (redis-py's default
    retry backs off for seconds against a node that is down)."""
    return redis.Redis(
        host=HOST,
        port=port,
        password=password,
        decode_responses=True,
        socket_timeout=1,
        socket_connect_timeout=1,
        retry=Retry(NoBackoff(), 0),
    )


def _binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (scripts/test.sh installs it)")
    return binary


def _pairs(reply: Any) -> dict[str, str]:
    """A Sentinel reply of alternating names and values (or a dict under RESP3) as a dict."""
    if isinstance(reply, dict):
        return {str(k): str(v) for k, v in reply.items()}
    return {str(k): str(v) for k, v in zip(reply[::2], reply[1::2], strict=True)}


@dataclass
class _Server:
    """One process of the group, started from its own config file in its own directory, so it
    keeps its port, data and (rewritten) config across restarts."""

    name: str
    workdir: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def address(self) -> Address:
        return (HOST, self.port)

    @property
    def conf(self) -> Path:
        return self.workdir / f"{self.name}.conf"

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self) -> list[str]:
        return [_binary(), str(self.conf)]

    def launch(self) -> None:
        assert not self.running, f"{self.name} is already running"
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        """``kill -9``: with ``everysec``, up to a second of writes may be lost."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def poll_client(self) -> redis.Redis:
        raise NotImplementedError

    def wait_answering(self, ready: Callable[[redis.Redis], bool], timeout_s: float) -> None:
        def answering() -> bool:
            if not self.running:
                raise RuntimeError(f"{self.name} on port {self.port} exited; see {self.log}")
            with self.poll_client() as c:
                try:
                    return ready(c)
                except redis.RedisError:
                    return False

        wait_until(answering, timeout_s, 0.02, f"{self.name} on port {self.port} answering")


@dataclass
class DataNode(_Server):
    """A primary or replica: ``replicaof`` is only in its first config; Sentinel rewrites it."""

    password: str = ""

    def write_conf(self, primary_port: int | None) -> None:
        lines = [
            f"bind {HOST}",
            f"port {self.port}",
            f'dir "{self.workdir}"',
            f'requirepass "{self.password}"',
            f'masterauth "{self.password}"',
            'notify-keyspace-events "Egx"',
            "appendonly yes",
            "appendfsync everysec",
            'save ""',
            # a demoted primary's full resync starts at once, not after the default 5 s wait
            "repl-diskless-sync-delay 0",
        ]
        if primary_port is not None:
            lines.append(f"replicaof {HOST} {primary_port}")
        self.conf.write_text("\n".join(lines) + "\n")

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host=HOST, port=self.port, password=self.password, **kwargs)

    def poll_client(self) -> redis.Redis:
        return _polling_client(self.port, self.password)

    def role(self) -> list[Any] | None:
        """``ROLE``'s reply, or None when the node does not answer."""
        with self.poll_client() as c:
            try:
                return list(c.execute_command("ROLE"))
            except redis.RedisError:
                return None

    def replicates(self, primary: Address) -> bool:
        """A replica of ``primary`` with its link up (synced)."""
        role = self.role()
        return (
            role is not None
            and role[0] == "slave"
            and (role[1], int(role[2])) == primary
            and role[3] == "connected"
        )

    def restore_masterauth(self) -> None:
        """Set ``masterauth`` back and into the config file, which Sentinel's ``CONFIG
        REWRITE`` may have saved with the wrong one (a restart would then never sync)."""
        with self.poll_client() as c:
            c.config_set("masterauth", self.password)
            c.config_rewrite()

    def start(self, timeout_s: float = 10.0) -> None:
        self.launch()
        self.wait_answering(lambda c: not c.info("persistence").get("loading", 0), timeout_s)


@dataclass
class SentinelNode(_Server):
    password: str | None = None

    def command(self) -> list[str]:
        return [*super().command(), "--sentinel"]

    def write_conf(
        self, primary_port: int, data_password: str, down_after_ms: int, failover_timeout_ms: int
    ) -> None:
        lines = [
            f"bind {HOST}",
            f"port {self.port}",
            f'dir "{self.workdir}"',
            f"sentinel monitor {MASTER_NAME} {HOST} {primary_port} 2",
            f"sentinel down-after-milliseconds {MASTER_NAME} {down_after_ms}",
            f"sentinel failover-timeout {MASTER_NAME} {failover_timeout_ms}",
            f"sentinel parallel-syncs {MASTER_NAME} 1",
            f'sentinel auth-pass {MASTER_NAME} "{data_password}"',
        ]
        if self.password:  # clients and the other Sentinels authenticate alike
            lines += [f'requirepass "{self.password}"', f'sentinel sentinel-pass "{self.password}"']
        self.conf.write_text("\n".join(lines) + "\n")

    def poll_client(self) -> redis.Redis:
        return _polling_client(self.port, self.password)

    def start(self, timeout_s: float = 10.0) -> None:
        self.launch()
        periods = [str(part) for item in SENTINEL_DEBUG.items() for part in item]
        self.wait_answering(
            lambda c: bool(c.execute_command("SENTINEL", "DEBUG", *periods)), timeout_s
        )

    def master_state(self) -> dict[str, str] | None:
        """``SENTINEL MASTER mymaster`` as a dict, or None when it does not answer."""
        with self.poll_client() as c:
            try:
                return _pairs(c.execute_command("SENTINEL", "MASTER", MASTER_NAME))
            except redis.RedisError:
                return None

    def primary(self) -> Address | None:
        with self.poll_client() as c:
            try:
                host, port = c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
            except (redis.RedisError, TypeError, ValueError):
                return None
        return (str(host), int(port))


class SentinelGroup:
    """A primary, two replicas and three Sentinels (quorum 2) monitoring ``mymaster``.

    ``password`` protects the data nodes (``requirepass`` and ``masterauth``) and is the one in
    :attr:`url`; ``sentinel_password`` protects the Sentinels (``requirepass`` and ``sentinel
    sentinel-pass``): by default one of their own, None for open Sentinels, or the data nodes'
    password passed again. Use as a context manager or call :meth:`close`.
    """

    master_name = MASTER_NAME

    def __init__(
        self,
        *,
        password: str | None = None,
        sentinel_password: str | None = _OWN,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        start: bool = True,
    ) -> None:
        self.password = password or f"data-{secrets.token_hex(8)}"
        self.sentinel_password: str | None = (
            f"sentinel-{secrets.token_hex(8)}" if sentinel_password is _OWN else sentinel_password
        )
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.workdir = Path(tempfile.mkdtemp(prefix="gpuhedge-sentinel-"))
        self.nodes = [
            DataNode(f"redis{i}", self._subdir(f"redis{i}"), password=self.password)
            for i in range(3)
        ]
        sentinel_pw = self.sentinel_password
        self.sentinels = [
            SentinelNode(f"sentinel{i}", self._subdir(f"sentinel{i}"), password=sentinel_pw)
            for i in range(3)
        ]
        self._closed = False
        atexit.register(self.close)  # an interrupted test run leaves no server behind
        if start:
            self.start()

    def _subdir(self, name: str) -> Path:
        path = self.workdir / name
        path.mkdir()
        return path

    # -- life cycle ----------------------------------------------------------------------------

    def start(self, timeout_s: float = 20.0) -> SentinelGroup:
        """Start every process; return once both replicas are in sync and each Sentinel knows
        them and the two other Sentinels (before that a failover could be refused or partial)."""
        try:
            primary = self.nodes[0]
            for node in self.nodes:
                node.write_conf(None if node is primary else primary.port)
                node.start()
            for sentinel in self.sentinels:
                sentinel.write_conf(
                    primary.port, self.password, self.down_after_ms, self.failover_timeout_ms
                )
                sentinel.start()
            wait_until(
                lambda: (
                    all(n.replicates(primary.address) for n in self.nodes[1:])
                    and self._sentinels_complete()
                ),
                timeout_s,
                0.05,
                "Sentinel group discovering its nodes",
            )
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> SentinelGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process of the group and remove its files; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        running = [s for s in (*self.sentinels, *self.nodes) if s.running and s.process]
        for server in running:  # all told at once: their clean AOF shutdowns overlap
            assert server.process is not None
            server.process.terminate()
        for server in running:
            assert server.process is not None
            stop_process(server.process, grace_s=5)
        shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def processes(self) -> list[subprocess.Popen]:
        """Every server process this group started (for checks that none is left)."""
        return [s.process for s in (*self.nodes, *self.sentinels) if s.process is not None]

    # -- what clients see ----------------------------------------------------------------------

    @property
    def sentinel_addresses(self) -> list[Address]:
        return [s.address for s in self.sentinels]

    @property
    def url(self) -> str:
        """``sentinel://:PASSWORD@host:port;...;sentinel://:PASSWORD@host:port/0?master=mymaster``
        with the data nodes' password (the Sentinels' own is :attr:`sentinel_password`)."""
        parts = [f"sentinel://:{self.password}@{h}:{p}" for h, p in self.sentinel_addresses]
        return ";".join(parts) + f"/0?master={self.master_name}"

    def sentinel_client(self, index: int = 0) -> redis.Redis:
        """A client of one Sentinel (authenticated), for ``SENTINEL ...`` commands."""
        return self.sentinels[index].poll_client()

    def _agreed(self) -> Address | None:
        """The primary every running Sentinel names, or None while they disagree."""
        views = [s.primary() for s in self.sentinels if s.running]
        if len(views) >= 2 and views[0] is not None and all(v == views[0] for v in views):
            return views[0]
        return None

    def primary(self, timeout_s: float = 5.0) -> Address:
        """The primary as every running Sentinel names it (waits while they disagree)."""
        return wait_until(self._agreed, timeout_s, 0.02, "Sentinels agreeing on the primary")

    def node(self, address: Address | DataNode) -> DataNode:
        if isinstance(address, DataNode):
            return address
        for node in self.nodes:
            if node.address == (address[0], int(address[1])):
                return node
        raise KeyError(f"no data node of this group at {address[0]}:{address[1]}")

    def client_for_primary(self, **kwargs: Any) -> redis.Redis:
        """A plain ``redis.Redis`` to the current primary (keyword arguments go to it)."""
        return self.node(self.primary()).client(**kwargs)

    def replicas(self, timeout_s: float = 5.0) -> list[Address]:
        """The current primary's replicas as the Sentinels list them, less those seen down (read
        from a Sentinel that has switched to it: the one leading a failover lists the old
        primary's replicas until it has finished)."""
        primary = self.primary(timeout_s)

        def listed() -> list[Any] | None:
            for sentinel in self.sentinels:
                state = sentinel.master_state() if sentinel.running else None
                if state is None or "failover_in_progress" in state.get("flags", ""):
                    continue
                if (state.get("ip"), int(state.get("port", 0))) != primary:
                    continue
                with sentinel.poll_client() as c:
                    return list(c.execute_command("SENTINEL", "REPLICAS", self.master_name))
            return None

        found = []
        for entry in wait_until(listed, timeout_s, 0.02, "a Sentinel listing the replicas"):
            info = _pairs(entry)
            address = (info["ip"], int(info["port"]))
            flags = set(info.get("flags", "").split(","))
            if address != primary and not flags & {"s_down", "o_down", "disconnected"}:
                found.append(address)
        return sorted(found)

    # -- failovers -----------------------------------------------------------------------------

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Wait until no running Sentinel has a failover in progress or sees the primary down
        (one that leads a failover keeps reporting its promoted replica, right or wrong, until
        it has finished)."""
        wait_until(self._sentinels_idle, timeout_s, 0.02, "Sentinels done with the last failover")

    def failover(self, timeout_s: float = 15.0) -> tuple[Address, Address]:
        """``SENTINEL FAILOVER mymaster``; returns (old, new) once the group has settled."""
        deadline = time.monotonic() + timeout_s
        self.wait_idle(timeout_s)
        old = self.primary()
        self._force_failover(deadline)
        return old, self._settle(old, deadline)

    def lossy_failover(
        self, write: Callable[[redis.Redis], object], timeout_s: float = 15.0
    ) -> tuple[Address, Address]:
        """A failover that loses whatever ``write(client_of_old_primary)`` wrote.

        The replicas are cut off first (a wrong ``masterauth``, then ``CLIENT KILL TYPE
        replica`` on the primary), so those writes are acknowledged by the old primary alone.
        ``SENTINEL FAILOVER`` then promotes a replica: it takes one whose link is down (for
        under 10 down-after periods) if that replica's INFO is fresh, which the info period
        of :data:`SENTINEL_DEBUG` ensures (with 100 ms it mostly answered NOGOODSLAVE). Each
        replica gets its ``masterauth`` back once it is the new primary or follows it, never
        while it could still resync from the old one; the old primary, demoted, fully resyncs
        from the new one and drops those writes. Returns (old, new) once the group has
        settled."""
        deadline = time.monotonic() + timeout_s
        self.wait_idle(timeout_s)
        old = self.primary()
        old_node = self.node(old)
        cut = [n for n in self.nodes if n is not old_node and n.running]
        try:
            for node in cut:
                with node.poll_client() as c:
                    c.config_set("masterauth", f"wrong-{secrets.token_hex(4)}")
            with old_node.poll_client() as c:
                c.execute_command("CLIENT", "KILL", "TYPE", "replica")
                wait_until(
                    lambda: (
                        c.info("replication")["connected_slaves"] == 0
                        and not any(n.replicates(old) for n in cut)
                    ),
                    max(0.1, deadline - time.monotonic()),
                    0.02,
                    "replicas cut off from the primary",
                )
            with old_node.client() as client:
                write(client)
            self._force_failover(deadline)

            def restore(new: Address) -> None:
                for node in list(cut):
                    role = node.role() or [""]
                    follows = role[0] == "slave" and (role[1], int(role[2])) == new
                    if node.address == new or follows:
                        node.restore_masterauth()
                        cut.remove(node)

            return old, self._settle(old, deadline, restore)
        finally:
            for node in cut:  # on failure only: leave no node unable to replicate
                try:
                    node.restore_masterauth()
                except redis.RedisError:
                    pass

    def kill_primary(self, timeout_s: float = 20.0) -> tuple[Address, Address]:
        """``kill -9`` the primary and let the Sentinels agree it is down, elect a leader and
        promote a replica; returns (old, new) once the group has settled without the old one
        (:meth:`restart` brings it back)."""
        deadline = time.monotonic() + timeout_s
        self.wait_idle(timeout_s)
        old = self.primary()
        self.node(old).kill()
        return old, self._settle(old, deadline)

    def restart(self, node: Address | DataNode, timeout_s: float = 15.0) -> DataNode:
        """Start a stopped data node again on its port, data and config (as Sentinel last
        rewrote it); returns once it is a connected replica of the current primary. One that
        comes back as a master, or following another node, is pointed at the primary at once
        (the Sentinels would do it too, seconds later)."""
        target = self.node(node)
        target.start(timeout_s)
        primary = self.primary(timeout_s)
        role = target.role() or [""]
        follows = role[0] == "slave" and (role[1], int(role[2])) == primary
        if target.address != primary and not follows:
            with target.poll_client() as c:
                c.replicaof(*primary)
        wait_until(
            lambda: target.address == primary or target.replicates(primary),
            timeout_s,
            0.02,
            f"{target.name} replicating from the primary",
        )
        return target

    def _force_failover(self, deadline: float) -> None:
        """``SENTINEL FAILOVER`` on the first Sentinel that takes it: one that has not yet read
        a replica's fresh INFO answers NOGOODSLAVE for a moment."""
        last: Exception | None = None
        while time.monotonic() < deadline:
            for sentinel in self.sentinels:
                if not sentinel.running:
                    continue
                with sentinel.poll_client() as c:
                    try:
                        c.execute_command("SENTINEL", "FAILOVER", self.master_name)
                        return
                    except redis.RedisError as e:
                        last = e
            time.sleep(0.05)
        raise AssertionError(f"no Sentinel accepted SENTINEL FAILOVER: {last}")

    def _settle(
        self, old: Address, deadline: float, on_poll: Callable[[Address], None] | None = None
    ) -> Address:
        """Wait until every running Sentinel names one primary other than ``old`` and has
        finished with it, that primary answers ROLE master, and every other running data node
        is its connected replica; return it. ``on_poll(new)`` runs on each poll once the
        Sentinels agree.

        Finished matters: the Sentinel that led the failover answers GET-MASTER-ADDR-BY-NAME
        with the new primary at once but SENTINEL MASTERS (what redis-py's discovery reads)
        with the old one until it is done. The old primary is told to replicate from the new
        one as soon as all Sentinels name it: they would do the same 4 hello periods later."""
        old_node = self.node(old)
        demoted = [False]

        def settled() -> Address | None:
            new = self._agreed()
            if new is None or new == old:
                return None
            if on_poll is not None:
                on_poll(new)
            if not demoted[0] and old_node.running:
                role = old_node.role()
                if role is None:
                    return None
                if role[0] == "master":
                    with old_node.poll_client() as c:
                        c.replicaof(*new)
                        # as a Sentinel's reconfiguration does: clients still connected to the
                        # demoted primary must reconnect and ask again, not read its stale data
                        c.execute_command("CLIENT", "KILL", "TYPE", "normal")
                        c.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
                demoted[0] = True
            for node in self.nodes:
                if not node.running:
                    continue
                if node.address == new:
                    role = node.role()
                    if role is None or role[0] != "master":
                        return None
                elif not node.replicates(new):
                    return None
            return new if self._sentinels_idle(new) else None

        return wait_until(
            settled, max(0.1, deadline - time.monotonic()), 0.02, f"failover away from {old}"
        )

    def _sentinels_idle(self, primary: Address | None = None) -> bool:
        """No running Sentinel has a failover in progress or sees the primary down (and, given
        ``primary``, each one's record of the primary is at that address)."""
        for sentinel in self.sentinels:
            if not sentinel.running:
                continue
            state = sentinel.master_state()
            if state is None or state.get("flags") != "master":
                return False
            if primary is not None and (state["ip"], int(state["port"])) != primary:
                return False
        return True

    def _sentinels_complete(self) -> bool:
        """Every Sentinel knows the two replicas and the two other Sentinels."""
        for sentinel in self.sentinels:
            state = sentinel.master_state()
            if state is None or state.get("flags") != "master":
                return False
            if int(state["num-slaves"]) < 2 or int(state["num-other-sentinels"]) < 2:
                return False
        return True
