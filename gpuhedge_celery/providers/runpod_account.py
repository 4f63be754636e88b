"""The ``runpod`` adapter's account hooks: ``login-check`` and ``costs`` through RunPod's GraphQL
account API (``POST <graphql_url>``, ``Authorization: Bearer <key>``).

* :func:`login_check`: ``query { myself { id } }``, one read-only call; the identity is the
  account id. 401/403: the key was refused; ``{"errors": [...]}`` (RunPod often answers them
  with HTTP 200): failed, with the first message.
* :func:`reported_spend`: RunPod reports a **balance**, not spend per day. Each call reads
  ``myself { id clientBalance currentSpendPerHr }`` and stores a snapshot
  (:class:`~gpuhedge_celery.store.balances.BalanceStore`); the spend reported is the balance's
  drop from an earlier snapshot of the same account (the first at or after ``since``, else the
  last before it) to now. This is *balance-derived* evidence: it counts everything the account
  paid for in between (idle windows, every other endpoint, storage), and a deposit between the
  snapshots hides spend (a balance that rose is reported unavailable).

Never retried (one-shot commands), never rate-budgeted against the endpoint (another API), and
no text here carries the key: every line goes through :func:`~.account.scrub`.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

import httpx

from .account import AVAILABLE, FAILED, OK, UNAVAILABLE, LoginCheck, SpendReport, no_answer, scrub

WHO = "query { myself { id } }"
BALANCE = "query { myself { id clientBalance currentSpendPerHr } }"
BALANCE_DERIVED = "balance-derived: includes idle billing and every other endpoint on the account"
FIRST = "first snapshot recorded; spend available from the next run"


class AccountError(Exception):
    """One GraphQL call failed: the text is one line and holds no secret."""

    def __init__(self, text: str, refused: bool = False):
        super().__init__(text)
        self.refused = refused


def query(provider: Any, text: str) -> dict[str, Any]:
    """``data.myself`` of one GraphQL query, or :class:`AccountError`."""
    key = provider.api._key
    url = provider.api.graphql_url
    what = f"GraphQL POST {urlsplit(url).path or '/'}"
    spec = provider.spec
    timeout = httpx.Timeout(spec.read_timeout_s, connect=spec.connect_timeout_s)
    try:
        with httpx.Client(transport=provider.api._transport, timeout=timeout) as client:
            response = client.post(
                url, json={"query": text}, headers={"authorization": f"Bearer {key}"}
            )
    except httpx.HTTPError as e:
        raise AccountError(no_answer(what, e, [key])) from None
    code = response.status_code
    if code in (401, 403):
        raise AccountError(f"{what}: HTTP {code}: key refused", refused=True)
    try:
        body = response.json()
    except ValueError:
        raise AccountError(scrub(f"{what}: HTTP {code}: response is not JSON", [key])) from None
    errors = body.get("errors") if isinstance(body, dict) else None
    if errors:
        first = errors[0] if isinstance(errors, list) else errors
        message = first.get("message") if isinstance(first, dict) else first
        raise AccountError(scrub(f"{what}: HTTP {code}: GraphQL error: {message}", [key]))
    if code >= 300:
        raise AccountError(scrub(f"{what}: HTTP {code}: {response.text[:120]}", [key]))
    myself = (body.get("data") or {}).get("myself") if isinstance(body, dict) else None
    if not isinstance(myself, dict) or not myself.get("id"):
        raise AccountError(f"{what}: HTTP {code}: no data.myself.id in the answer")
    return myself


def login_check(provider: Any) -> LoginCheck:
    try:
        myself = query(provider, WHO)
    except AccountError as e:
        return LoginCheck(provider.name, FAILED, "", str(e))
    account = scrub(str(myself["id"]), [provider.api._key])
    return LoginCheck(provider.name, OK, account, "GraphQL myself { id }: key accepted")


def _when(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, tz=timezone.utc).strftime("%Y-%m-%dT%H:%MZ")


def reported_spend(provider: Any, since: float, now: float | None = None) -> SpendReport:
    """The balance's drop since an earlier snapshot (see the module docstring)."""
    from ..store.balances import Snapshot

    name = provider.name
    try:
        myself = query(provider, BALANCE)
        usd = float(myself["clientBalance"])
    except AccountError as e:
        return SpendReport(name, UNAVAILABLE, None, since, detail=str(e))
    except (KeyError, TypeError, ValueError):
        detail = "GraphQL myself: field 'clientBalance' is missing or not a number"
        return SpendReport(name, UNAVAILABLE, None, since, detail=detail)
    store = provider.balances
    if store is None:
        detail = f"balance ${usd:,.4f}: no snapshot store (costs keeps them in Redis)"
        return SpendReport(name, UNAVAILABLE, None, since, detail=detail)
    now = time.time() if now is None else now
    account = str(myself["id"])
    earlier = [s for s in store.all(name) if s.account == account and s.at < now]
    store.add(name, Snapshot(now, usd, account))
    if not earlier:
        return SpendReport(name, UNAVAILABLE, None, since, detail=FIRST)
    after = [s for s in earlier if s.at >= since]
    base = after[0] if after else earlier[-1]
    drop = round(base.usd - usd, 9)
    span = f"balance ${base.usd:,.4f} at {_when(base.at)} -> ${usd:,.4f} now"
    if drop < 0:
        detail = f"{span}: it rose (a deposit or credit?): spend cannot be derived across it"
        return SpendReport(name, UNAVAILABLE, None, base.at, detail=detail)
    rate = myself.get("currentSpendPerHr")
    rate_text = f"; now ${float(rate):,.4f}/h" if isinstance(rate, (int, float)) else ""
    return SpendReport(
        name, AVAILABLE, drop, base.at, detail=f"{BALANCE_DERIVED}: {span}{rate_text}"
    )
