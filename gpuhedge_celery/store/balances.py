"""Account balance snapshots in Redis: what ``costs`` derives spend from where a provider reports
a balance and no spend (RunPod's ``clientBalance``).

One sorted set per provider (:meth:`~.keys.Keys.balance_snapshots`), members JSON
``{at, usd, account}`` scored by ``at`` (epoch s), the newest ``KEEP`` kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .keys import Keys
from .timers import store_errors

KEEP = 1000


@dataclass(frozen=True)
class Snapshot:
    at: float
    usd: float
    account: str


class BalanceStore:
    """Reads and appends balance snapshots (one provider's account each)."""

    def __init__(self, client: Any, prefix: str = "gpuhedge"):
        self.client = client
        self.keys = Keys(prefix)

    def add(self, provider: str, snap: Snapshot) -> None:
        key = self.keys.balance_snapshots(provider)
        member = json.dumps({"at": snap.at, "usd": snap.usd, "account": snap.account})
        with store_errors("writing a balance snapshot"):
            pipe = self.client.pipeline(transaction=True)
            pipe.zadd(key, {member: snap.at})
            pipe.zremrangebyrank(key, 0, -KEEP - 1)
            pipe.execute()

    def all(self, provider: str) -> list[Snapshot]:
        """Every kept snapshot, oldest first."""
        with store_errors("reading balance snapshots"):
            raw = self.client.zrange(self.keys.balance_snapshots(provider), 0, -1)
        out = []
        for member in raw:
            data = json.loads(member)
            out.append(Snapshot(float(data["at"]), float(data["usd"]), str(data["account"])))
        return out
