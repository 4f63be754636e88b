"""Webhook delivery for the loopback provider fakes, with each platform's retry behaviour.

A :class:`Deliverer` keeps a schedule of pending deliveries (a heap) on one thread and POSTs
each when due on a few sender threads. ``schedule(at, fire)``: at monotonic time ``at``,
``fire()`` says what to do: ``("send", url, body bytes)``, ``("later", at)`` (the job has not
ended yet: look again then) or ``None`` (nothing to deliver). A send is tried up to
``attempts`` times, ``gap_s`` apart; with ``retry_5xx`` false a 5xx answer ends it (Cerebrium's
behaviour); any other failure (a 4xx, a timeout, a refused connection) is retried. Counters:
``sent`` (a 2xx got), ``attempts``, ``failed`` (gave up), ``dropped`` (by fault injection).
"""

from __future__ import annotations

import heapq
import http.client
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

Fire = Callable[[], Any]


class Deliverer:
    def __init__(self, *, attempts: int = 3, gap_s: float = 5.0, retry_5xx: bool = True,
                 timeout_s: float = 10.0, threads: int = 8):  # fmt: skip
        self.attempts, self.gap_s, self.retry_5xx = attempts, gap_s, retry_5xx
        self.timeout_s = timeout_s
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="fake-webhook")
        self.counts: dict[str, Any] = {
            "sent": 0,
            "attempts": 0,
            "failed": 0,
            "dropped": 0,
            "codes": {},
        }
        self._count_lock = threading.Lock()
        threading.Thread(target=self._run, name="fake-webhook-clock", daemon=True).start()

    def schedule(self, at: float, fire: Fire, tries: int = 0) -> None:
        with self._cv:
            heapq.heappush(self._heap, (at, next(self._seq), (fire, tries)))
            self._cv.notify()

    def clear(self) -> None:
        with self._cv:
            self._heap.clear()
        with self._count_lock:
            self.counts = {"sent": 0, "attempts": 0, "failed": 0, "dropped": 0, "codes": {}}

    def count(self, key: str, n: int = 1) -> None:
        with self._count_lock:
            self.counts[key] += n

    def stats(self) -> dict[str, Any]:
        with self._count_lock:
            return {**self.counts, "codes": dict(self.counts["codes"]), "pending": len(self._heap)}

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cv.wait(wait)
                _, _, (fire, tries) = heapq.heappop(self._heap)
            self._pool.submit(self._fire, fire, tries)

    def _fire(self, fire: Fire, tries: int) -> None:
        try:
            what: Any = fire() if tries == 0 else fire
        except Exception:
            return
        if what is None:
            return
        if what[0] == "later":
            self.schedule(what[1], fire)
            return
        _, url, body = what
        code = self._post(url, body)
        self.count("attempts")
        with self._count_lock:
            self.counts["codes"][str(code)] = self.counts["codes"].get(str(code), 0) + 1
        if 200 <= code < 300:
            self.count("sent")
            return
        last = tries + 1 >= self.attempts or (code >= 500 and not self.retry_5xx)
        if last:
            self.count("failed")
            return
        self.schedule(time.monotonic() + self.gap_s, what, tries + 1)

    def _post(self, url: str, body: bytes) -> int:
        parts = urlsplit(url)
        conn_cls = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        conn = conn_cls(parts.hostname or "127.0.0.1", parts.port, timeout=self.timeout_s)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request("POST", path or "/", body=body,
                         headers={"content-type": "application/json"})  # fmt: skip
            response = conn.getresponse()
            response.read()
            return response.status
        except (OSError, http.client.HTTPException):
            return 0  # refused, reset or timed out: no answer
        finally:
            conn.close()
