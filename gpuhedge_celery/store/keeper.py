"""Keeps a held lease alive from a daemon thread, and says loudly when it is lost.

Renewal runs every ``ttl / 3``. A renewal that Redis refuses (the lease expired or was taken
over) means the lease is lost at once. A renewal that cannot reach Redis is retried until the
lease's own deadline passes (measured on ``time.monotonic``), because until then the lease may
still be ours. Either way the keeper sets ``lost`` and calls ``on_lost(lease, exc)`` exactly
once; the thread never ends silently with the lease presumed held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ..core.lease_rules import Lease
from ..errors import LeaseLost, StoreUnavailable

log = logging.getLogger(__name__)

OnLost = Callable[[Lease, BaseException], None]


class Renews(Protocol):
    """What a keeper needs of its store (a :class:`~gpuhedge_celery.store.leases.LeaseStore`,
    which builds on this module and re-exports :class:`LeaseKeeper`)."""

    def renew(self, lease: Lease) -> Lease: ...


class LeaseKeeper:
    """Renews ``lease`` every ``interval_s`` (default ttl/3) until stopped or lost."""

    def __init__(
        self,
        store: Renews,
        lease: Lease,
        *,
        on_lost: OnLost | None = None,
        interval_s: float | None = None,
    ):
        self.store = store
        self.lease = lease
        self.on_lost = on_lost
        self.interval_s = interval_s if interval_s is not None else lease.ttl_ms / 3000
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        self.lost = threading.Event()
        self.error: BaseException | None = None
        self.renewals = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LeaseKeeper:
        """Start renewing in a daemon thread; returns self for ``with``-free chaining."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"lease-keeper-{self.lease.gpu_id}", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing (the lease itself is left as it is: release it separately)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(5.0, self.interval_s * 2))

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        # The lease is valid until its TTL runs out after the last successful renewal.
        valid_until = time.monotonic() + self.lease.ttl_ms / 1000
        while not self._stop.wait(self.interval_s):
            try:
                started = time.monotonic()
                self.lease = self.store.renew(self.lease)
                valid_until = started + self.lease.ttl_ms / 1000
                self.renewals += 1
            except LeaseLost as e:
                self._declare_lost(e)
                return
            except StoreUnavailable as e:
                if time.monotonic() >= valid_until:
                    self._declare_lost(e)
                    return
                log.warning("lease renewal for GPU %s failed, retrying: %s", self.lease.gpu_id, e)
            except BaseException as e:  # noqa: BLE001 - a keeper must never die silently
                self._declare_lost(e)
                return

    def _declare_lost(self, exc: BaseException) -> None:
        self.error = exc
        self.lost.set()
        log.error("lease on GPU %s lost: %s", self.lease.gpu_id, exc)
        if self.on_lost is not None:
            try:
                self.on_lost(self.lease, exc)
            except Exception:  # noqa: BLE001 - report, but the lease is lost regardless
                log.exception("on_lost callback for GPU %s failed", self.lease.gpu_id)
