"""Taking a GPU out of the pool and back: drained, faulted, unhealthy, or its model not ready.

A GPU is out of the pool while its hash ``<prefix>:{pool:<pool>}:out:<gpu>`` has any field
(reason -> ``since_ms|detail``). The claim scripts (``claim.lua``, ``wait_claim.lua``) read that
hash in the same step as the lease, so a GPU that is out never gets a new lease, not even from a
waiter that listed it as a candidate a second ago; a job already running there finishes. Each
reason has one owner:

=========  ===================================================  ===========================
reason     set by                                               cleared by
=========  ===================================================  ===========================
drain      ``gpuhedge-celery gpus drain``                       ``gpus undrain``
fault      the worker's health check (ECC or Xid errors)        ``gpus undrain``
health     the worker's health check (a foreign process holds   the worker, once it is gone
           the GPU's memory)
runner     the worker: its model is loading, failed to load,    the worker, once it serves
           its child is recycling, or its model server is down
=========  ===================================================  ===========================

Clearing the last reason publishes the pool on the wake channel, so waiters claim at once.
"""

from __future__ import annotations

import json
from typing import Any

from ..core.lease_rules import OUT_REASONS, STICKY_REASONS, GpuInfo, out_value, parse_out
from ..errors import ConfigError
from .leases import LeaseStore, _text, now_ms


def _check_reason(reason: str) -> str:
    if reason not in OUT_REASONS:
        raise ConfigError(f"expected one of {', '.join(OUT_REASONS)}, got {reason!r}", key="reason")
    return reason


def set_out(store: LeaseStore, gpu_id: str, reason: str, detail: str) -> None:
    """Keep ``gpu_id`` out of the pool for ``reason`` (a one-line ``detail`` says why). Setting a
    reason again updates its detail and keeps the moment it was first set."""
    key = store.keys.out(store.pool_of(gpu_id), gpu_id)
    with store.guard():
        old = _text(store.client.hget(key, _check_reason(reason)))
        since = parse_out({reason: old})[reason]["since_ms"] if old else now_ms()
        store.client.hset(key, reason, out_value(" ".join(detail.split()), since or now_ms()))


def clear_out(store: LeaseStore, gpu_id: str, *reasons: str) -> bool:
    """Drop ``reasons``; True when the GPU is back in the pool (waiters are woken then)."""
    for reason in reasons:
        _check_reason(reason)
    k = store.keys
    pool = store.pool_of(gpu_id)
    with store.guard():
        back = store.scripts.out_clear(
            keys=[k.out(pool, gpu_id), k.gpu(pool, gpu_id)], args=[k.wake_channel(), *reasons]
        )
    return int(back) == 1


def out_reasons(store: LeaseStore, gpu_id: str) -> dict[str, dict[str, Any]]:
    """Why ``gpu_id`` is out of the pool: reason -> ``{detail, since_ms}`` (empty: in the pool)."""
    pool = store.pool_or_none(gpu_id)
    if pool is None:
        return {}
    with store.guard():
        fields = store.client.hgetall(store.keys.out(pool, gpu_id))
    return parse_out({_text(a): _text(b) for a, b in fields.items()})


def write_health(store: LeaseStore, gpu_id: str, sample: dict[str, Any], ttl_ms: int) -> None:
    """Publish the GPU's last health sample (``leases`` shows it until it is ``ttl_ms`` old)."""
    key = store.keys.health(store.pool_of(gpu_id), gpu_id)
    with store.guard():
        store.client.set(key, json.dumps(sample, sort_keys=True), px=ttl_ms)


def resolve_targets(store: LeaseStore, target: str) -> list[GpuInfo]:
    """The registered GPUs ``target`` names: a GPU id (``box:1``), every GPU of a host (``box``,
    the host part of GPU ids), or the GPU(s) of a worker node (``gpu1@box``). ConfigError if none.
    """
    gpus = store.gpus(live_only=False)
    exact = [g for g in gpus if g.gpu_id == target]
    if exact:
        return exact
    found = [g for g in gpus if g.gpu_id.rpartition(":")[0] == target or g.host == target]
    if not found:
        known = sorted({g.gpu_id.rpartition(":")[0] for g in gpus})
        raise ConfigError(
            f"no registered GPU matches {target!r} (expected HOST or HOST:GPU; hosts: "
            f"{', '.join(known) or 'none'})",
            key="HOST[:GPU]",
        )
    return found


def drain(store: LeaseStore, gpu_ids: list[str], detail: str = "drained by an operator") -> None:
    """Take GPUs out of the pool until :func:`undrain`: no new lease; a running job finishes."""
    for gpu_id in gpu_ids:
        set_out(store, gpu_id, STICKY_REASONS[0], detail)


def undrain(store: LeaseStore, gpu_ids: list[str]) -> dict[str, bool]:
    """Clear operator drains and health faults; GPU id -> whether it is back in the pool (False:
    another reason still keeps it out, e.g. its model is not loaded)."""
    return {gpu_id: clear_out(store, gpu_id, *STICKY_REASONS) for gpu_id in gpu_ids}


def busy(store: LeaseStore, gpu_ids: list[str]) -> list[str]:
    """The GPUs among ``gpu_ids`` that still hold a lease or run a job."""
    k = store.keys
    held = set()
    with store.guard():
        for gpu_id in gpu_ids:
            pool = store.pool_or_none(gpu_id)
            if pool is not None and store.client.exists(
                k.lease(pool, gpu_id), k.running(pool, gpu_id)
            ):
                held.add(gpu_id)
    return [g for g in gpu_ids if g in held]
