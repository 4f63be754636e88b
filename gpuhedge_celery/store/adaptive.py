"""What adaptive policies share through Redis: observations, request numbers and hedge tokens.

Every coordinator keeps its own :class:`~gpuhedge_celery.core.adaptive_learn.Learner` and feeds
it, in the same order, from one stream per policy name that each finished race appends to, so
every coordinator plans from the same evidence. The request counter and the hedge budget's
bucket are one hash, changed by two small scripts, so a budget holds across the fleet.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from ..core.adaptive_learn import CAPACITY
from .keys import Keys
from .scripts import lua_script

SEEN_MAXLEN = 4096  # observations kept per policy (a learner weighs a few hundred at most)
TOOK_TTL_MS = 3_600_000  # a race's token marker outlives any step it could be applied again in
FIELD = "o"

log = logging.getLogger(__name__)


class AdaptiveStore:
    """One Redis's view of the adaptive policies' shared state."""

    def __init__(self, client: Any, prefix: str = "gpuhedge"):
        self.client = client
        self.keys = Keys(prefix)

    def next_request(self, policy: str, budget: float | None) -> tuple[int, float | None]:
        """The next request's number and, with a budget, the tokens after its refill."""
        script = lua_script(self.client, "adaptive_next")
        seq, tokens = script(
            keys=[self.keys.adaptive_counts(policy)],
            args=["" if budget is None else repr(float(budget)), repr(CAPACITY)],
        )
        text = tokens.decode() if isinstance(tokens, bytes) else str(tokens)
        return int(seq), (float(text) if text else None)

    def take_token(self, policy: str, key: str = "") -> bool:
        """Spend one hedge token; False when the bucket is empty (nothing spent). ``key``
        (race and role) spends at most one: asked again, it answers True at no cost."""
        script = lua_script(self.client, "adaptive_take")
        counts = self.keys.adaptive_counts(policy)
        keys = [counts, self.keys.adaptive_took(policy, key)] if key else [counts]
        return bool(script(keys=keys, args=[repr(CAPACITY), TOOK_TTL_MS]))

    def append_seen(self, policy: str, observed: Mapping[str, Any]) -> None:
        """Append one finished race's observation to the policy's stream."""
        line = json.dumps(observed, separators=(",", ":"))
        self.client.xadd(
            self.keys.adaptive_seen(policy), {FIELD: line}, maxlen=SEEN_MAXLEN, approximate=True
        )

    def seen_since(
        self, policy: str, after: str = "0-0", count: int = 1000
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Observations appended after the entry id ``after``, oldest first, as (id, data)."""
        key = self.keys.adaptive_seen(policy)
        while True:
            entries = self.client.xrange(key, min=f"({after}", count=count)
            for entry_id, fields in entries:
                after = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                raw = fields.get(FIELD.encode(), fields.get(FIELD))
                try:
                    yield after, json.loads(raw)
                except (TypeError, ValueError):
                    log.warning(
                        "adaptive %s: entry %s is not an observation; skipped", policy, after
                    )
            if len(entries) < count:
                return

    def counts(self, policy: str) -> dict[str, Any]:
        """The policy's ``seq``, ``tokens`` and ``reset`` as numbers and ``plan`` as the
        published dict (each absent when not there)."""
        raw = self.client.hgetall(self.keys.adaptive_counts(policy))
        out: dict[str, Any] = {}
        for k, v in raw.items():
            key = k.decode() if isinstance(k, bytes) else str(k)
            out[key] = json.loads(v) if key == "plan" else float(v)
        return out

    def publish(self, policy: str, shown: Mapping[str, Any]) -> None:
        """Publish a coordinator's last fit (plan, estimate, what it learned from)."""
        self.client.hset(self.keys.adaptive_counts(policy), "plan", json.dumps(shown))
        # a command of its own: the set of every policy is in no policy's slot on a cluster
        self.client.sadd(self.keys.adaptive_policies(), policy)

    def policies(self) -> list[str]:
        """Adaptive policy names that published a plan, sorted."""
        names = self.client.smembers(self.keys.adaptive_policies())
        return sorted(n.decode() if isinstance(n, bytes) else str(n) for n in names)

    def seen_count(self, policy: str) -> int:
        """Observations the policy's stream holds."""
        return int(self.client.xlen(self.keys.adaptive_seen(policy)))

    def reset(self, policy: str) -> None:
        """Forget what the policy learned (its observations and budget); bump ``reset`` so
        every coordinator's learner starts again too."""
        counts = self.keys.adaptive_counts(policy)
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.adaptive_seen(policy))
        pipe.hdel(counts, "tokens", "plan")
        pipe.hincrby(counts, "reset", 1)
        pipe.execute()
