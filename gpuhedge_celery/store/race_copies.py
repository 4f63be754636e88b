"""The copies of races' states a process keeps: what it last saved, and what it last read.

* **Saved here** (:meth:`StateCopies.saved_copy`): the race store's ``load(fresh=True)`` answers
  from it without a round trip. It may be stale (another process saved since), so only a
  caller that saves with a version check and reloads on a conflict may use it.
* **Either** is the base a save's delta is computed from (:mod:`.race_parts`): a copy of the
  version the save expects, with the id of the save that wrote that version, which the save
  script checks against the race's history of saves before it applies the delta.

Both are bounded (least recently kept first out) and never go back to an older version: two
threads' saves can finish their round trips in one order and be kept in the other, and an older
copy would show a step that the newer one took back (an attempt launched by the newer save
missing from it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple

from . import race_parts
from .timers import as_text

COPIES_MAX = 4096  # races per kind of copy a process keeps


class Copy(NamedTuple):
    """A race's state (as parts) at one version."""

    version: int
    save_id: str  # the save that wrote this version ('' when unknown: no delta from it)
    parts: dict[str, str]


def history_head(history: Any) -> tuple[int, str]:
    """The version and save id heading a state's history of saves ("version:id ...")."""
    entry = as_text(history or "").split(" ", 1)[0]
    version, _, save_id = entry.partition(":")
    return (int(version), save_id) if version.isdigit() else (0, "")


class StateCopies:
    """Thread-safe copies of races' states, by race id."""

    def __init__(self, limit: int = COPIES_MAX):
        self.limit = limit
        self._saved: OrderedDict[str, Copy] = OrderedDict()
        self._read: OrderedDict[str, Copy] = OrderedDict()
        self._lock = threading.Lock()

    def keep_saved(self, race_id: str, copy: Copy) -> None:
        """Keep what this process just saved (unless it keeps a newer copy)."""
        with self._lock:
            self._keep(self._saved, race_id, copy)

    def keep_read(
        self, race_id: str, version: int, fields: dict[Any, Any], parts: dict[str, str] | None
    ) -> None:
        """Keep a state just read from Redis (its hash's ``fields``, their ``parts``), when its
        history names the save that wrote it and it is in parts (a whole state from an older
        version is no base)."""
        head_version, save_id = history_head(race_parts.field(fields, "s"))
        if parts is None or head_version != version or not save_id or race_parts.whole(fields):
            return
        with self._lock:
            self._keep(self._read, race_id, Copy(version, save_id, parts))

    def forget(self, race_id: str) -> None:
        """Drop both copies (a save lost its version check: they are stale)."""
        with self._lock:
            self._saved.pop(race_id, None)
            self._read.pop(race_id, None)

    def saved_copy(self, race_id: str) -> Copy | None:
        """What this process last saved of the race, if it keeps it."""
        with self._lock:
            return self._saved.get(race_id)

    def base(self, race_id: str, version: int) -> Copy | None:
        """A copy of the race at ``version`` whose writer is known, if this process keeps one."""
        if version <= 0:
            return None
        with self._lock:
            for found in (self._saved.get(race_id), self._read.get(race_id)):
                if found is not None and found.version == version and found.save_id:
                    return found
        return None

    def _keep(self, lru: OrderedDict[str, Copy], race_id: str, copy: Copy) -> None:
        found = lru.get(race_id)
        if found is not None and found.version >= copy.version:
            return
        lru[race_id] = copy
        lru.move_to_end(race_id)
        while len(lru) > self.limit:
            lru.popitem(last=False)
