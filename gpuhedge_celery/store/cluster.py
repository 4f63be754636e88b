"""The store's client of a Redis Cluster (``redis+cluster://``): single commands as redis-py's
``RedisCluster`` sends them (routed by key, redirects followed), pipelines held to one slot.

redis-py's own cluster pipeline refuses ``EVALSHA``, and every save of this package is a pipeline
of scripts. A :class:`SlotPipeline` is queued like redis-py's ``Pipeline``; at ``execute()`` all
its keyed commands must hash to one slot (a script's keys are read from its ``numkeys``, other
commands' through redis-py's key table) and it is sent as one plain pipeline, one round trip, to
the primary that owns the slot. Commands without a key (``PUBLISH``, ``WAIT``, ``TIME``,
``PING``) go with it. A pipeline spanning slots is refused before anything is sent.

Redirects: a node that does not own the slot answers ``MOVED``, one migrating it away answers
``ASK`` for a key it no longer holds, ``TRYAGAIN`` for a command whose keys the migration split,
and ``CLUSTERDOWN`` while the cluster is not serving. Each is a refusal before the command ran,
so exactly the refused commands are sent again (to the owner a ``MOVED`` names, which corrects
the client's slot table, or after ``ASKING`` to the importing node), with every keyless command
queued after the first of them (a ``WAIT`` must follow the writes it covers to their node; a
``PUBLISH`` among them is then delivered twice). A transaction is refused as a whole and sent
again whole. A connection lost mid-pipeline is not resent: whether it ran is unknown.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import redis
import redis.client
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterCrossSlotError,
    ClusterDownError,
    ClusterError,
    MovedError,
    RedisClusterException,
    TryAgainError,
)

from ..redis_url import ClusterUrl, cluster_location

TRIES = 10  # sends of one pipeline's refused commands before giving up
BACKOFF_S = 0.05  # before a TRYAGAIN or CLUSTERDOWN is sent again; doubled each time
BACKOFF_MAX_S = 0.5

_SCRIPT_CALLS = frozenset({"EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO"})
# keyless in a cluster, read without the key table (which counts a PUBLISH's channel as a key)
_KEYLESS = frozenset({"PUBLISH", "WAIT", "TIME", "PING"})
# what a node answers before running a command: sending it again cannot run it twice
_REFUSALS = (AskError, TryAgainError, ClusterDownError)  # MovedError is an AskError
Command = tuple[tuple[Any, ...], dict[str, Any]]


class CrossSlotPipeline(ClusterCrossSlotError):  # type: ignore[misc]  # redis-py is untyped here
    """A pipeline's keys hash to more than one slot: nothing was sent."""


class ClusterClient:
    """A Redis Cluster client for the store: :attr:`cluster` (redis-py's ``RedisCluster``)
    answers every command, :meth:`pipeline` gives a :class:`SlotPipeline`."""

    def __init__(self, cluster: RedisCluster, spec: ClusterUrl):
        self.cluster = cluster
        self.spec = spec

    @classmethod
    def from_spec(cls, spec: ClusterUrl, **kwargs: Any) -> ClusterClient:
        """A client of the cluster ``spec`` names; ``kwargs`` go to every node's connections.
        redis-py reads the topology at once: no seed answering is a ``redis.ConnectionError``,
        as an unreachable single server is at its first command."""
        kwargs.pop("db", None)  # a cluster has database 0 only (the URL says so)
        if spec.username:
            kwargs.setdefault("username", spec.username)
        if spec.password is not None:
            kwargs.setdefault("password", spec.password)
        if spec.tls:
            kwargs["ssl"] = True
            if spec.ssl_ca_certs:
                kwargs.setdefault("ssl_ca_certs", spec.ssl_ca_certs)
        seeds = [ClusterNode(host, port) for host, port in spec.nodes]
        try:
            cluster = RedisCluster(startup_nodes=seeds, **kwargs)
        except RedisClusterException as e:
            raise redis.ConnectionError(f"{cluster_location(spec)}: {e}") from e
        return cls(cluster, spec)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> SlotPipeline:
        """A pipeline of one slot (``transaction``: wrapped in MULTI/EXEC, as redis-py's)."""
        if shard_hint is not None:
            raise ValueError("a cluster pipeline takes no shard_hint: its keys pick the node")
        return SlotPipeline(self.cluster, transaction)

    @property
    def location(self) -> str:
        """The seed nodes, without credentials (``rediss+cluster://`` for TLS)."""
        return cluster_location(self.spec)

    def known_primaries(self) -> frozenset[str]:
        """``host:port`` of the primaries this client routes to (its cached topology)."""
        return frozenset(node.name for node in self.cluster.get_primaries())

    def primaries_not_in(self, known: frozenset[str]) -> list[str]:
        """``host:port`` of each healthy primary owning slots now, as one node of the cluster
        tells (one round trip), that none of the ``known`` names (``host:port``, as this
        client names nodes) is: a promoted replica or an added primary shows here before this
        client's own topology follows. A node is matched by its address or its announced
        hostname, and one that never learned its own address by its port alone."""
        missing = []
        for address, info in self.cluster.cluster_nodes().items():
            raw = info.get("flags", "")
            flags = set(raw.split(",") if isinstance(raw, str) else raw)
            unhealthy = flags & {"fail", "fail?", "handshake", "noaddr"}
            if "master" not in flags or unhealthy or not info.get("slots"):
                continue
            host, _, port = address.rpartition(":")
            names = {address}
            if info.get("hostname"):
                names.add(f"{info['hostname']}:{port}")
            if names & known or (not host and any(k.rpartition(":")[2] == port for k in known)):
                continue
            missing.append(address)
        return sorted(missing)

    def primary_clients(self) -> list[tuple[str, redis.Redis]]:
        """``(host:port, client)`` of each primary this client routes to: for what each node
        says of itself (its persistence, its replicas, its key events)."""
        cluster = self.cluster
        return [(node.name, cluster.get_redis_connection(node)) for node in cluster.get_primaries()]

    def refresh(self) -> None:
        """Read the topology again (redis-py does so by itself only when a command fails or is
        redirected, which a pub/sub connection never is)."""
        self.cluster.nodes_manager.initialize()

    def __getattr__(self, name: str) -> Any:
        # every command but pipeline() is RedisCluster's own (not before there is one)
        if name == "cluster" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.cluster, name)

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cluster.close()

    def __repr__(self) -> str:
        return f"ClusterClient({self.location})"


class SlotPipeline(redis.client.Pipeline):  # type: ignore[misc]  # its command methods
    """Commands of one slot, queued like redis-py's ``Pipeline`` and sent in one round trip to
    the primary that owns the slot (see the module doc). ``WATCH`` pins the slot at once."""

    connection: Any  # redis-py's: the connection that watches, while one does

    def __init__(self, cluster: RedisCluster, transaction: bool):
        node = cluster.get_redis_connection(cluster.get_default_node())
        super().__init__(node.connection_pool, node.response_callbacks, transaction, None)
        self.cluster = cluster
        self.slot: int | None = None  # set by WATCH: later commands must keep to it

    def reset(self) -> None:
        super().reset()
        self.slot = None

    def immediate_execute_command(self, *args: Any, **options: Any) -> Any:
        # WATCH and the reads after it run at once, on the connection that watches
        slot = slot_of(self.cluster, [(args, options)], self.slot)
        if self.slot is None and slot is not None:
            return self._watch(slot, args, options)
        try:
            return super().immediate_execute_command(*args, **options)
        except _REFUSALS as e:  # the watched slot moved away: the caller starts again
            self._after_refusal(e, self.slot, 0)
            raise redis.WatchError(f"the watched slot moved ({type(e).__name__})") from e

    def _watch(self, slot: int, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
        node = self._primary(slot)
        for attempt in range(TRIES):
            self.connection_pool = self._node_client(node).connection_pool
            try:
                reply = super().immediate_execute_command(*args, **options)
            except _REFUSALS as e:  # nothing is watched yet: take the connection back
                if self.connection is not None:
                    self.connection_pool.release(self.connection)
                    self.connection = None
                node = self._after_refusal(e, slot, attempt)
                continue
            self.slot = slot
            return reply
        raise ClusterError(f"{args[0]} on slot {slot} was refused {TRIES} times by the cluster")

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack: list[Command] = self.command_stack
        if not stack and not self.watching:
            return []
        try:
            slot = slot_of(self.cluster, stack, self.slot)
            replies = self._send_watched(stack) if self.watching else self._send(stack, slot)
        finally:
            self.reset()
        if raise_on_error:
            self.raise_first_error(stack, replies)
        return replies

    def _send(self, stack: list[Command], slot: int | None) -> list[Any]:
        replies: list[Any] = [None] * len(stack)
        pending = list(range(len(stack)))
        node, asking = self._primary(slot), False
        for attempt in range(TRIES):
            try:
                got = self._run(node, [stack[i] for i in pending], asking)
            except _REFUSALS as e:  # a transaction is refused whole: none of it ran
                refusal: Exception = e
            else:
                for i, reply in zip(pending, got, strict=True):
                    replies[i] = reply
                refused = [n for n, reply in enumerate(got) if isinstance(reply, _REFUSALS)]
                if not refused:
                    return replies
                refusal = got[refused[0]]
                # the refused commands, and the keyless ones after the first: a WAIT must
                # follow the writes it covers to their node
                pending = [
                    i
                    for n, i in enumerate(pending)
                    if n in refused
                    or (n > refused[0] and not command_keys(self.cluster, stack[i][0]))
                ]
            node = self._after_refusal(refusal, slot, attempt)
            asking = isinstance(refusal, AskError) and not isinstance(refusal, MovedError)
        raise ClusterError(f"a pipeline of slot {slot} was refused {TRIES} times by the cluster")

    def _send_watched(self, stack: list[Command]) -> list[Any]:
        # the transaction must run on the connection that watches: a refusal ends the watch
        node_pipe = redis.client.Pipeline(
            self.connection_pool, self.response_callbacks, self.transaction, None
        )
        node_pipe.connection, self.connection = self.connection, None
        node_pipe.watching = True
        node_pipe.explicit_transaction = self.explicit_transaction
        node_pipe.command_stack = list(stack)
        node_pipe.scripts = self.scripts
        try:
            replies: list[Any] = node_pipe.execute(raise_on_error=False)
            return replies
        except _REFUSALS as e:
            self._after_refusal(e, self.slot, 0)
            raise redis.WatchError(f"the watched slot moved ({type(e).__name__})") from e

    def _run(self, node: ClusterNode, batch: list[Command], asking: bool) -> list[Any]:
        """``batch`` as one plain pipeline on ``node``: its replies, errors among them."""
        client = self._node_client(node)
        pipe = client.pipeline(transaction=self.transaction)
        pipe.scripts = self.scripts
        replies: list[Any]
        try:
            if asking and self.transaction:  # ASKING lasts until EXEC inside MULTI
                pipe.immediate_execute_command("ASKING")
            elif asking:  # ASKING lasts one command
                pipe.command_stack = [c for cmd in batch for c in ((("ASKING",), {}), cmd)]
                replies = pipe.execute(raise_on_error=False)
                return replies[1::2]
            pipe.command_stack = list(batch)
            replies = pipe.execute(raise_on_error=False)
            return replies
        except (redis.ConnectionError, redis.TimeoutError):
            self._refresh()  # the next pipeline finds the slot's new owner, if it moved
            raise
        finally:
            pipe.reset()

    def _after_refusal(self, error: Exception, slot: int | None, attempt: int) -> ClusterNode:
        """Where to send the refused commands next (after waiting, for TRYAGAIN/CLUSTERDOWN)."""
        manager = self.cluster.nodes_manager
        if isinstance(error, MovedError):
            # the refusing node names the slot's owner: patched in, as redis-py does (a full
            # read of the topology would also drop the connections a seed node has in use)
            manager.update_moved_exception(error)
            return self._primary(slot)
        if isinstance(error, AskError):
            node = manager.get_node(error.host, error.port)
            if node is None:
                self._refresh()
                node = manager.get_node(error.host, error.port) or ClusterNode(*error.node_addr)
            return node
        time.sleep(min(BACKOFF_MAX_S, BACKOFF_S * 2**attempt))
        if isinstance(error, ClusterDownError):
            self._refresh()
        return self._primary(slot)

    def _refresh(self) -> None:
        try:
            self.cluster.nodes_manager.initialize()
        except (redis.RedisError, RedisClusterException):
            pass  # the command's own error says more; the next call reads the topology again

    def _primary(self, slot: int | None) -> ClusterNode:
        if slot is None:
            return self.cluster.get_default_node()
        return self.cluster.nodes_manager.get_node_from_slot(slot)

    def _node_client(self, node: ClusterNode) -> redis.Redis:
        return self.cluster.get_redis_connection(node)


def command_keys(cluster: RedisCluster, args: Sequence[Any]) -> Sequence[Any]:
    """The keys of one command: a script's from its ``numkeys``, others' from redis-py's table
    of the server's commands; none for a keyless command (and for ``PUBLISH``)."""
    name = str(args[0]).upper()
    if name in _SCRIPT_CALLS:
        return args[3 : 3 + int(args[2])]
    if name in _KEYLESS:
        return ()
    connection = cluster.get_redis_connection(cluster.get_default_node())
    # the table reads a subcommand's name from the second argument, whatever its type
    words = [a if isinstance(a, str | bytes) else str(a) for a in args]
    return cluster.commands_parser.get_keys(connection, *words) or ()


def _keyed(cluster: RedisCluster, commands: Sequence[Command]) -> Iterator[tuple[Any, int]]:
    for args, _ in commands:
        for key in command_keys(cluster, args):
            yield key, cluster.keyslot(key)


def slot_of(cluster: RedisCluster, commands: Sequence[Command], pinned: int | None) -> int | None:
    """The one slot of ``commands``' keys (``pinned``: the slot a WATCH already holds), None
    when they have no key; :class:`CrossSlotPipeline` naming two keys and their slots when
    they span more than one."""
    first: tuple[Any, int] | None = None
    for key, slot in _keyed(cluster, commands):
        if first is None:
            first = (key, slot)
            if pinned is not None and slot != pinned:
                raise CrossSlotPipeline(
                    f"a pipeline watching slot {pinned} also names {key!r} (slot {slot}); "
                    "a cluster pipeline keeps to one slot"
                )
        elif slot != first[1]:
            raise CrossSlotPipeline(
                f"a pipeline names {first[0]!r} (slot {first[1]}) and {key!r} (slot {slot}); "
                "a cluster pipeline keeps to one slot: give its keys one hash tag"
            )
    return first[1] if first is not None else pinned
