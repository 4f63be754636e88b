"""One pub/sub connection per process that turns lease-key events into waiter wake-ups.

The listener subscribes to the ``del`` and ``expired`` key-event channels of the store's
database and to the store's wake channel, and sets the ``threading.Event`` of every waiter that
watches the key (or pool) named in a message. Events are hints only: waiters re-check on a
bounded interval anyway, because ``expired`` can arrive seconds late and pub/sub drops whatever
is published while the connection is down.

After a reconnect (redis-py re-subscribes by itself; we see the fresh ``subscribe``
confirmations) the listener wakes every waiter, so each re-reads the table before any event
is trusted again.

The listener also carries the process's liveness for the wait queue (see :mod:`.liveness`): it
stays subscribed to the process's own channel, which Redis drops the moment the process dies,
and runs its :class:`~.liveness.ProcessBeat` heartbeat. Waiters put its ``process_id`` in their
queue entries.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections.abc import Iterable
from typing import Any

import redis

from ..errors import NotificationsUnavailable, StoreUnavailable
from .cluster import ClusterClient
from .connection import client_location, database_number
from .keys import Keys
from .liveness import ProcessBeat

log = logging.getLogger(__name__)

REQUIRED_FLAGS = "Egx"
TOPOLOGY_EVERY_S = 2.0  # how often a listener on a cluster checks it listens to every primary
_warned: set[str] = set()
_warned_lock = threading.Lock()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _where(client: redis.Redis) -> str:
    return client_location(client)


def servers(client: Any) -> list[Any]:
    """A client per server whose key events the listener needs: ``client`` itself, or on a
    Redis Cluster one per primary (each node publishes its own keys' events only)."""
    if isinstance(client, ClusterClient):
        return [server for _, server in client.primary_clients()]
    return [client]


def merged_flags(current: str) -> str | None:
    """``current`` notify-keyspace-events flags plus E, g and x; None if nothing is missing."""
    has_gx = "A" in current or ("g" in current and "x" in current)
    if "E" in current and has_gx:
        return None
    missing = "".join(
        f for f in REQUIRED_FLAGS if f not in current and not (f in "gx" and "A" in current)
    )
    return current + missing


def enable_notifications(client: redis.Redis) -> bool:
    """Make sure key-event notifications for ``del`` and ``expired`` are on (adds E, g, x).

    Flags already set are kept. Returns False, logging one line with the fix (once per server
    and process), when CONFIG is forbidden, as on managed Redis; waiters then rely on their
    bounded re-check. Raises StoreUnavailable when Redis cannot be reached.
    """
    where = _where(client)
    try:
        for server in servers(client):
            current = _text(
                server.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
            )
            wanted = merged_flags(current)
            if wanted is not None:
                server.config_set("notify-keyspace-events", wanted)
        return True
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise StoreUnavailable(f"Redis at {where} is unreachable ({e})") from e
    except redis.ResponseError as e:
        with _warned_lock:
            first = where not in _warned
            _warned.add(where)
        if first:
            log.warning(
                "cannot enable keyspace notifications on %s (CONFIG refused: %s); set "
                "notify-keyspace-events to include 'Egx' (managed Redis such as ElastiCache: in "
                "the parameter group); until then waiters fall back to their bounded re-check",
                where,
                str(e).splitlines()[0],
            )
        return False


def require_notifications(client: redis.Redis) -> None:
    """Like :func:`enable_notifications`, but raise NotificationsUnavailable (one line, with the
    fix) when CONFIG is forbidden: for commands whose whole job is to switch events on."""
    try:
        for server in servers(client):
            current = server.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
            wanted = merged_flags(_text(current))
            if wanted is not None:
                server.config_set("notify-keyspace-events", wanted)
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise StoreUnavailable(f"Redis at {_where(client)} is unreachable ({e})") from e
    except redis.ResponseError as e:
        raise NotificationsUnavailable(
            f"cannot enable keyspace notifications on {_where(client)}: CONFIG refused "
            f"({str(e).splitlines()[0][:60]}); set notify-keyspace-events to include 'Egx' "
            "(ElastiCache: in the parameter group)"
        ) from e


class Watch:
    """A waiter's registration: its event is set when a watched key or pool may have changed."""

    def __init__(self, listener: KeyspaceListener, keys: frozenset[str], pool: str):
        self.listener = listener
        self.keys = keys
        self.pool = pool
        self.event = threading.Event()

    def close(self) -> None:
        self.listener._unregister(self)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Subscriptions:
    """The listener's pub/sub connections: one on a single server; on a Redis Cluster one per
    primary, because each node publishes key events of its own keys only and counts only its
    own subscribers in ``PUBSUB NUMSUB`` (the process channel, read by the scripts of whichever
    node holds a pool). The wake channel goes to the first connection alone: a cluster forwards
    a PUBLISH to every node."""

    def __init__(self, pubsubs: list[Any], channels: int, primaries: frozenset[str]):
        self.pubsubs = pubsubs
        self.channels = channels  # subscribe confirmations to expect, on all connections
        self.primaries = primaries  # host:port of the primaries subscribed to (cluster only)

    @classmethod
    def of(cls, client: Any, channels: tuple[str, ...]) -> Subscriptions:
        """Subscribed (confirmations still to read) to ``channels``: the two key-event channels,
        the wake channel, the process channel (the wake channel on the first server only)."""
        primaries = client.known_primaries() if isinstance(client, ClusterClient) else frozenset()
        found = servers(client)
        pubsubs = []
        everywhere = channels[:2] + channels[3:]
        for i, server in enumerate(found):
            pubsub = server.pubsub(ignore_subscribe_messages=False)
            pubsub.subscribe(*(channels if i == 0 else everywhere))
            pubsubs.append(pubsub)
        return cls(pubsubs, len(channels) + len(everywhere) * (len(found) - 1), primaries)

    def get_message(self, timeout: float) -> dict[str, Any] | None:
        """The next message of any connection, waiting at most ``timeout`` s for one."""
        if len(self.pubsubs) == 1:
            msg: dict[str, Any] | None = self.pubsubs[0].get_message(timeout=timeout)
            return msg
        for pubsub in self.pubsubs:  # one already read into a buffer comes first
            msg = pubsub.get_message(timeout=0)
            if msg is not None:
                return msg
        socks = [p.connection._sock for p in self.pubsubs if p.connection is not None]
        # a selector, not select(): a long-lived process's sockets may be numbered past 1024
        with selectors.DefaultSelector() as ready:
            for sock in socks:
                if sock is not None:
                    ready.register(sock, selectors.EVENT_READ)
            ready.select(timeout)
        for pubsub in self.pubsubs:
            msg = pubsub.get_message(timeout=0)
            if msg is not None:
                return msg
        return None

    def close(self) -> None:
        for pubsub in self.pubsubs:
            try:
                pubsub.close()
            except Exception:  # noqa: BLE001 - closing: the connection may be broken already
                pass


class KeyspaceListener:
    """The process's pub/sub reader for one Redis database and key prefix."""

    def __init__(self, client: redis.Redis, keys: Keys):
        self.client = client
        self.keys = keys
        db = database_number(client)
        self._beat = ProcessBeat(client, keys)
        self.process_id = self._beat.process_id
        self.channels = (
            f"__keyevent@{db}__:del",
            f"__keyevent@{db}__:expired",
            keys.wake_channel(),
            keys.proc_channel(self.process_id),  # liveness only: nothing is published here
        )
        self.notifications = False  # whether enable_notifications succeeded
        self.reconnects = 0  # times the pub/sub connection came back (each wakes every waiter)
        self.messages = 0
        self._resubscribed = 0
        self._connected = False
        self._by_key: dict[str, set[Watch]] = {}
        self._by_pool: dict[str, set[Watch]] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._pubsub: Any = None
        self._thread: threading.Thread | None = None
        self._topology_at = 0.0  # when a cluster's primaries are next compared with ours
        self._topology_every = TOPOLOGY_EVERY_S  # grows while the same primaries stay missing
        self._missing: list[str] = []  # what the last comparison found unsubscribed

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, timeout_s: float = 5.0) -> KeyspaceListener:
        """Enable notifications, subscribe, and return once the subscription is active."""
        if self._thread is not None and self._thread.is_alive():
            return self
        self.notifications = enable_notifications(self.client)
        self._ready.clear()
        self._error = None
        self._thread = threading.Thread(target=self._run, name="gpuhedge-listener", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            self.close()
            raise StoreUnavailable(f"could not subscribe to lease events: {self._error}")
        try:
            self._beat.start()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self.close()
            raise StoreUnavailable(f"Redis at {_where(self.client)} is unreachable ({e})") from e
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped.is_set()

    @property
    def primaries(self) -> frozenset[str]:
        """``host:port`` of the cluster primaries subscribed to now (empty on one server, or
        while reconnecting)."""
        pubsub = self._pubsub
        return frozenset() if pubsub is None else pubsub.primaries

    def close(self) -> None:
        """Stop the threads, close the pub/sub connection and mark the process gone."""
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._beat.close()

    # -- registrations ----------------------------------------------------------------------
    def beat_for(self, pool: str) -> None:
        """Keep this process's heartbeat in ``pool`` while a wait on it lasts (see
        :class:`~.liveness.ProcessBeat`); pair with :meth:`beat_done`."""
        self._beat.join(pool)

    def beat_done(self, pool: str) -> None:
        """A wait on ``pool`` ended (its heartbeat there stops with the last one)."""
        self._beat.leave(pool)

    def watch(self, lease_keys: Iterable[str], pool: str) -> Watch:
        """Register interest in ``lease_keys`` and in wake messages for ``pool``."""
        w = Watch(self, frozenset(lease_keys), pool)
        with self._lock:
            for key in w.keys:
                self._by_key.setdefault(key, set()).add(w)
            self._by_pool.setdefault(pool, set()).add(w)
        return w

    def rewatch(self, w: Watch, lease_keys: Iterable[str]) -> None:
        """Change the keys a watch covers (the pool's live GPUs changed)."""
        new = frozenset(lease_keys)
        with self._lock:
            for key in w.keys - new:
                self._discard(self._by_key, key, w)
            for key in new - w.keys:
                self._by_key.setdefault(key, set()).add(w)
            w.keys = new

    def _unregister(self, w: Watch) -> None:
        with self._lock:
            for key in w.keys:
                self._discard(self._by_key, key, w)
            self._discard(self._by_pool, w.pool, w)

    @staticmethod
    def _discard(index: dict[str, set[Watch]], name: str, w: Watch) -> None:
        found = index.get(name)
        if found is not None:
            found.discard(w)
            if not found:
                del index[name]

    def wake_all(self) -> None:
        """Wake every waiter (after a reconnect: re-check the table before trusting events)."""
        with self._lock:
            watches = {w for ws in self._by_pool.values() for w in ws}
        for w in watches:
            w.event.set()

    # -- the reader thread ------------------------------------------------------------------
    def _subscribe(self) -> None:
        pubsub = Subscriptions.of(self.client, self.channels)
        confirmed = 0
        deadline = time.monotonic() + 5
        while confirmed < pubsub.channels:
            if time.monotonic() > deadline:
                pubsub.close()
                raise redis.TimeoutError("no subscribe confirmation within 5 s")
            msg = pubsub.get_message(timeout=0.5)
            if msg and msg["type"] == "subscribe":
                confirmed += 1
        self._pubsub = pubsub

    def _run(self) -> None:
        backoff = 0.05
        try:
            while not self._stopped.is_set():
                try:
                    if self._pubsub is None:
                        self._subscribe()
                        self._connected = True
                        if self._ready.is_set():
                            self._reconnected()
                        self._ready.set()
                        backoff = 0.05
                    msg = self._pubsub.get_message(timeout=0.2)
                    if msg is not None:
                        self._dispatch(msg)
                    if self._primaries_changed():
                        # a promoted replica or an added primary publishes its own keys'
                        # events only: subscribe again on the primaries there are now
                        self._drop(None)
                except Exception as e:  # noqa: BLE001 - a listener that dies leaves waiters deaf
                    if not isinstance(e, redis.ConnectionError | redis.TimeoutError | OSError):
                        log.error("lease event listener failed (%r); reconnecting", e)
                    self._drop(e)
                    self._refresh_topology()
                    if not self._ready.is_set():
                        self._error = e
                        self._ready.set()
                        return
                    self._stopped.wait(backoff)
                    backoff = min(backoff * 2, 1.0)
        finally:
            self._drop(None)

    def _primaries_changed(self) -> bool:
        """On a cluster, every ``TOPOLOGY_EVERY_S`` whether messages flow or not: whether a
        primary owning slots is one not subscribed to (the client's topology is read again
        when so). One subscribed to that no longer is (failed, demoted) is left alone: a failed
        one breaks the connection. The same primaries still missing after subscribing again
        (a name this client cannot reach them by) are checked less and less often, up to
        twice a minute, so they never cause a storm of subscriptions."""
        if not isinstance(self.client, ClusterClient) or time.monotonic() < self._topology_at:
            return False
        self._topology_at = time.monotonic() + self._topology_every  # whatever happens below
        try:
            missing = self.client.primaries_not_in(self._pubsub.primaries)
        except Exception as e:  # noqa: BLE001 - the node asked is gone: the connections will say
            log.debug("reading the cluster's primaries failed: %r", e)
            return False
        if not missing:
            self._topology_every, self._missing = TOPOLOGY_EVERY_S, []
            return False
        if missing == self._missing:  # subscribed again last time, and still not reached
            self._topology_every = min(self._topology_every * 2, 30.0)
            if self._topology_every == 30.0:
                log.warning("cluster primaries %s stay unsubscribed: no node name reaches them",
                            missing)  # fmt: skip
        self._missing = missing
        log.info("cluster primaries %s not listened to: lease events subscribed again", missing)
        self._refresh_topology()
        return True

    def _refresh_topology(self) -> None:
        if isinstance(self.client, ClusterClient):
            try:
                self.client.refresh()
            except Exception:  # noqa: BLE001 - no node answers: the next reconnect tries again
                pass

    def _drop(self, error: BaseException | None) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                pubsub.close()
            except Exception:  # noqa: BLE001 - the connection is already broken
                pass
        if error is not None:
            # One warning per outage, not one per reconnect attempt.
            if self._connected:
                log.warning("lease event connection lost (%s); reconnecting", error)
            self._connected = False
            self.wake_all()

    def _reconnected(self) -> None:
        self.reconnects += 1
        self._renotify()
        self.wake_all()

    def _renotify(self) -> None:
        """Switch key events on again: the server now answering may be a replica promoted by
        Sentinel, or a restarted Redis, that never had them."""
        try:
            self.notifications = enable_notifications(self.client)
        except Exception as e:  # noqa: BLE001 - gone again: the next reconnect tries once more
            log.debug("switching key events on again failed: %r", e)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "subscribe":
            # redis-py re-subscribed after a dropped connection: events published meanwhile
            # are lost, so every waiter re-reads the table.
            if self._ready.is_set():
                # Wake on each confirmation: the last one comes after every channel is back.
                self._resubscribed += 1
                if self._pubsub is None or self._resubscribed % self._pubsub.channels == 0:
                    self.reconnects += 1
                    self._renotify()
                self.wake_all()
            return
        if kind != "message":
            return
        self.messages += 1
        channel, data = _text(msg["channel"]), _text(msg["data"])
        with self._lock:
            if channel == self.channels[2]:
                targets = list(self._by_pool.get(data, ()))
            else:
                targets = list(self._by_key.get(data, ()))
        for w in targets:
            w.event.set()


_listeners: dict[tuple[int, str, str], KeyspaceListener] = {}
_listeners_lock = threading.Lock()


def listener_for(client: redis.Redis, keys: Keys) -> KeyspaceListener:
    """The started listener of this process for ``client``'s database and ``keys``' prefix."""
    key = (os.getpid(), _where(client), keys.prefix)
    with _listeners_lock:
        found = _listeners.get(key)
        if found is None or not found.alive:
            found = KeyspaceListener(client, keys).start()
            _listeners[key] = found
        return found


def close_listeners() -> None:
    """Stop every listener of this process (tests, shutdown)."""
    with _listeners_lock:
        found = list(_listeners.values())
        _listeners.clear()
    for listener in found:
        listener.close()
