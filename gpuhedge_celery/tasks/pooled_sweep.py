"""The reconcile pass's sweep: send again a pooled request that nobody will ever finish.

A pooled request is recorded before its message is sent, and marked taken by the process of
the delivery that takes it (``store/pooled.py``). Two ways it can be orphaned:

* **Lost before any worker took it.** A record still untaken :data:`STALE_S` after it was
  sent is looked for in the broker: its queue's lists and the unacknowledged messages (one Lua
  script on the broker's Redis, so nothing is copied out). A request found on neither, on two
  sweeps at least :data:`MISSING_S` apart, is sent again. Two sweeps apart, because a message
  is briefly on neither while a worker moves it from the queue to its unacknowledged set. Only
  the Redis broker loses a message this way (``appendfsync everysec`` losing its last writes
  at a crash; kombu's pop-then-record-unacked at a worker's ``kill -9``), and only there can
  the sweep see what the broker holds; with RabbitMQ this half does nothing (a persistent
  message is written before the broker confirms it).
* **Its process died while it waited for a GPU.** A request taken by a process that is no
  longer alive (the wait queue's own liveness: heartbeat and subscription,
  ``store/liveness.py``) is sent again at once. Without this the Redis broker would redeliver
  it only after its visibility timeout (an hour by default); RabbitMQ redelivers it when the
  connection drops, and the second copy then finds the request taken by a live process and is
  dropped.

* **Handed to a GPU whose job never ran.** A request handed to a GPU whose lease (the GPU and
  token saved at the handoff) is no longer held, on two sweeps at least :data:`MISSING_S`
  apart, while its record still says handed, is sent again: the process that held the lease
  died between the handoff and sending the GPU job, or the broker lost that message. A job
  that ran ends the record within milliseconds of releasing its lease (hence two sweeps); a
  job that lost its lease sends the request back to waiting itself, and a late copy of the GPU
  job is refused by the lease's fence and does the same (the newer attempt takes over).

A request sent again keeps its task id, so the caller's ``.get()`` gets its result as if
nothing had happened; a copy of the old message that turns up later is dropped as a duplicate.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from celery import states

from ..store.pooled import PooledRecords, PoolRecords
from .app import QUEUE_POOL, TASK_POOLED_INFER

log = logging.getLogger(__name__)

STALE_S = 10.0  # an untaken request younger than this is left alone: its message is on its way
MISSING_S = 2.0  # found missing on two sweeps at least this far apart: sent again
ORPHAN_MIN_AGE_S = 1.0  # a request taken this recently is left to its taker
LIMIT = 100  # requests looked at per pass, of each kind

# KEYS: the lists to search, then the hashes; ARGV[1]: how many lists; ARGV[2..]: task ids.
# Returns the ids found in any element (the id is in the message's headers, as text).
FIND_IDS = """
local nlists = tonumber(ARGV[1])
local want, found = {}, {}
for i = 2, #ARGV do want[#want + 1] = ARGV[i] end
local function scan(items)
  for _, item in ipairs(items) do
    for j = #want, 1, -1 do
      if string.find(item, want[j], 1, true) then
        found[#found + 1] = want[j]
        table.remove(want, j)
      end
    end
    if #want == 0 then return end
  end
end
for k = 1, #KEYS do
  if #want == 0 then break end
  if k <= nlists then
    scan(redis.call('LRANGE', KEYS[k], 0, -1))
  else
    scan(redis.call('HVALS', KEYS[k]))
  end
end
return found
"""


def resend_lost(
    celery_app: Any, records: PooledRecords, now_ms: int | None = None, leases: Any = None
) -> list[str]:
    """One sweep; returns the ids of the requests sent again (``leases``: the lease store, to
    look at handed requests; without it they are not looked at)."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    resent = []
    for pool in records.pools():  # each pool's records and indexes are on its own slot
        mine = records.of(pool)
        resent += resend_orphaned(celery_app, mine, now_ms)
        resent += resend_unseen(celery_app, mine, now_ms)
        if leases is not None:
            resent += resend_unrun(celery_app, mine, leases, now_ms)
    return resent


def resend_unrun(celery_app: Any, records: PoolRecords, leases: Any, now_ms: int) -> list[str]:
    """Send again the handed requests whose GPU lease ended with no GPU job to end them."""
    resent = []
    for request_id in records.handed_before(now_ms - int(MISSING_S * 1000), LIMIT):
        handed = records.handed_to(request_id)
        if handed is None:
            continue
        gpu_id, token, taker = handed
        lease = leases.current(gpu_id)
        if lease is not None and lease.token == token:
            records.found(request_id)  # its GPU job holds the lease: running, or about to
        elif now_ms - records.missing_since(request_id, now_ms) >= MISSING_S * 1000:
            if _send_again(celery_app, records, request_id, "handed", taker, now_ms):
                log.warning(
                    "pooled request %s: handed to GPU %s under token %d, whose lease "
                    "ended with no GPU job ending the request; sent again",
                    request_id,
                    gpu_id,
                    token,
                )
                resent.append(request_id)
    return resent


def resend_orphaned(celery_app: Any, records: PoolRecords, now_ms: int) -> list[str]:
    """Send again the requests whose taking process died while they waited."""
    resent = []
    for request_id, taker in records.dead_takers(int(ORPHAN_MIN_AGE_S * 1000), LIMIT):
        if taker and _send_again(celery_app, records, request_id, "taken", taker, now_ms):
            log.warning(
                "pooled request %s: its process %s died while it waited for a GPU; sent again",
                request_id,
                taker,
            )
            resent.append(request_id)
    return resent


def resend_unseen(celery_app: Any, records: PoolRecords, now_ms: int) -> list[str]:
    """Send again the untaken requests whose message is nowhere in a Redis broker."""
    waiting: dict[str, str] = {}  # request id -> its queue
    for request_id in records.untaken_since(now_ms - int(STALE_S * 1000), LIMIT):
        arguments = records.arguments(request_id)
        if arguments is None:  # its record expired or ended
            records.drop(request_id)
        else:
            waiting[request_id] = arguments[2] or QUEUE_POOL
    if not waiting:
        return []
    present = in_redis_broker(celery_app, sorted(set(waiting.values())), list(waiting))
    if present is None:
        return []  # not a Redis broker: nothing is lost there this way, nothing can be seen
    resent = []
    for request_id in waiting:
        if request_id in present:
            records.found(request_id)
        elif now_ms - records.missing_since(request_id, now_ms) >= MISSING_S * 1000:
            if _send_again(celery_app, records, request_id, "sent", "", now_ms):
                log.warning(
                    "pooled request %s: its message was on no queue and "
                    "unacknowledged by no worker on two sweeps, and no worker took it; "
                    "sent again",
                    request_id,
                )
                resent.append(request_id)
    return resent


def _send_again(
    celery_app: Any, records: PoolRecords, request_id: str, state: str, taker: str, now_ms: int
) -> bool:
    """Mark the request sent (if it is still as the sweep saw it) and send it, same task id;
    never one whose result or error is stored already (its end could not forget the record)."""
    if celery_app.backend.get_task_meta(request_id).get("status") in states.READY_STATES:
        records.forget(request_id)
        return False
    arguments = records.requeue(request_id, state, taker, now_ms)
    if arguments is None:
        return False
    args, kwargs, queue = arguments
    celery_app.send_task(
        TASK_POOLED_INFER, args=args, kwargs=kwargs, task_id=request_id, queue=queue or QUEUE_POOL
    )
    return True


def in_redis_broker(celery_app: Any, queues: list[str], task_ids: list[str]) -> set[str] | None:
    """Which of ``task_ids`` have a message in one of ``queues`` or among the unacknowledged
    messages of a Redis broker; None when the broker is not Redis."""
    with celery_app.connection_for_read() as conn:
        channel = conn.default_channel
        if not hasattr(channel, "_q_for_pri") or not hasattr(channel, "unacked_key"):
            return None
        prefix = getattr(channel, "global_keyprefix", "") or ""
        lists = [
            prefix + channel._q_for_pri(queue, pri)
            for queue in queues
            for pri in channel.priority_steps
        ]
        hashes = [prefix + channel.unacked_key]
        plain = redis.Redis(connection_pool=channel.client.connection_pool)  # no key prefixing
        found = plain.eval(
            FIND_IDS, len(lists) + len(hashes), *lists, *hashes, len(lists), *task_ids
        )
    return {v.decode() if isinstance(v, bytes) else str(v) for v in found}
