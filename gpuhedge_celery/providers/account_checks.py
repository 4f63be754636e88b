"""The account hooks of the built-in adapters (``login-check`` and ``costs``), one function each.

Each adapter's ``login_check`` / ``reported_spend`` delegates here, so the adapters keep their
job contract and this module keeps what each platform can and cannot prove about an account:

=========  ==============================================  ===================================
adapter    login check (one read-only call)                reported spend
=========  ==============================================  ===================================
sim        nothing to call: always ok                      none: simulated, nothing is billed
pool       the pool's live GPUs in the lease table         none: self-hosted, no provider bill
http       one status GET of a probe id: 401/403 fail,     none: a generic job API has no
           any other answer means the key was accepted     billing API (Cerebrium has none)
modal      the function's lookup (``hydrate``)             the workspace billing report (whole
                                                           UTC days, rows of the app)
cerebrium  ``GET`` of the app on the management API        none: Cerebrium has no account-spend
           (``rest_url``, the API cancels go to): 2xx      API
           ok; 401/403 key refused; 404 app not found
=========  ==============================================  ===================================

The ``runpod`` adapter's hooks (GraphQL ``myself``; spend derived from balance snapshots) live
in ``runpod_account.py``.

Nothing here ever returns a secret: every text goes through :func:`~.account.scrub`. (The
adapters import this module, so it names them only in prose.)
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote, urlsplit

from .account import (
    AVAILABLE,
    FAILED,
    OK,
    UNAVAILABLE,
    UNSUPPORTED,
    LoginCheck,
    SpendReport,
    no_answer,
    scrub,
)

PROBE_JOB_ID = "gpuhedge-login-check"
CEREBRIUM_NO_SPEND = "Cerebrium has no account-spend API: unavailable"
DAY_S = 86400


# --------------------------------------------------------------------------- sim, pool
def sim_login_check(provider: Any) -> LoginCheck:
    return LoginCheck(provider.name, OK, "simulated", "no account: nothing to call")


def sim_spend(provider: Any, since: float) -> SpendReport:
    return SpendReport(provider.name, UNAVAILABLE, None, since, detail="simulated: nothing billed")


def pool_login_check(provider: Any) -> LoginCheck:
    pool = provider.spec.name
    try:
        gpus = provider.store.live_gpus(pool)
    except Exception as e:
        detail = scrub(f"{type(e).__name__}: {e}", [])
        return LoginCheck(provider.name, FAILED, f"pool {pool}", detail)
    if not gpus:
        return LoginCheck(provider.name, FAILED, f"pool {pool}", "no live GPU in the pool")
    return LoginCheck(provider.name, OK, f"pool {pool}", f"{len(gpus)} live GPU(s)")


def pool_spend(provider: Any, since: float) -> SpendReport:
    detail = "self-hosted GPUs: no provider bill (the ledger's estimate is the figure)"
    return SpendReport(provider.name, UNAVAILABLE, None, since, detail=detail)


# --------------------------------------------------------------------------- http
def _host(provider: Any) -> str:
    return urlsplit(provider._base_url).hostname or "?"


def http_login_check(provider: Any) -> LoginCheck:
    """One status GET of a job id that does not exist: read-only, and authenticated like any
    status call. 401/403 means the key was refused; 2xx/400/404 that the API accepted it."""
    ep = provider.spec.status
    host = _host(provider)
    what = f"status {ep.label} probe"  # the label starts with the method
    try:
        response = provider._client_for_pid().request(
            ep.method, provider._url("status", PROBE_JOB_ID)
        )
    except Exception as e:
        return LoginCheck(provider.name, FAILED, host, no_answer(what, e, provider.secrets()))
    code = response.status_code
    if code in (401, 403):
        return LoginCheck(provider.name, FAILED, host, f"{what}: HTTP {code}: key refused")
    if code < 300 or code in (400, 404):
        return LoginCheck(provider.name, OK, host, f"{what}: HTTP {code}: key accepted")
    return LoginCheck(provider.name, FAILED, host, f"{what}: HTTP {code}")


def http_spend(provider: Any, since: float) -> SpendReport:
    host = _host(provider)
    if host.endswith("cerebrium.ai"):
        detail = CEREBRIUM_NO_SPEND
    elif host.endswith("runpod.ai") or host.endswith("runpod.io"):
        detail = "the http adapter reads no billing API (RunPod's account API: runpod adapter)"
    else:
        detail = "the http adapter reads no billing API"
    return SpendReport(provider.name, UNAVAILABLE, None, since, detail=detail)


# --------------------------------------------------------------------------- modal
def modal_login_check(provider: Any) -> LoginCheck:
    label = provider.target.label
    lookup = getattr(provider.client, "lookup", None)
    if not callable(lookup):
        return LoginCheck(provider.name, UNSUPPORTED, label, "this SDK seam has no lookup")
    try:
        object_id = provider.calls.run(
            lambda: lookup(provider.target), provider.spec.spawn_timeout_s, "lookup"
        )
    except Exception as e:
        return LoginCheck(provider.name, FAILED, label, scrub(str(e), provider.secrets()))
    return LoginCheck(provider.name, OK, label, f"function found ({object_id})")


def day_start(epoch_s: float) -> float:
    """The UTC midnight at or before ``epoch_s``."""
    return float(int(epoch_s // DAY_S) * DAY_S)


def modal_spend(provider: Any, since: float, now: float | None = None) -> SpendReport:
    """The app's cost in Modal's workspace billing report, whole UTC days from ``since``'s day
    up to today (today is not reported until it ends)."""
    billing = getattr(provider.client, "billing", None)
    name = provider.name
    if not callable(billing):
        return SpendReport(name, UNAVAILABLE, None, since, detail="this SDK seam has no billing")
    start, until = day_start(since), day_start(time.time() if now is None else now)
    if until <= start:
        detail = "Modal reports whole UTC days only: nothing before today is asked for"
        return SpendReport(name, UNAVAILABLE, None, start, until, detail)
    begin = datetime.fromtimestamp(start, tz=timezone.utc)
    end = datetime.fromtimestamp(until, tz=timezone.utc)
    try:
        rows = provider.calls.run(
            lambda: billing(begin, end), provider.spec.spawn_timeout_s, "billing"
        )
    except Exception as e:
        detail = scrub(f"billing report: {e}", provider.secrets())
        return SpendReport(name, UNAVAILABLE, None, start, until, detail)
    env = provider.target.environment
    mine = [
        r
        for r in rows
        if r.get("description") == provider.target.app
        and (env is None or r.get("environment_name") in (env, ""))
    ]
    usd = round(sum(float(r.get("cost") or 0.0) for r in mine), 9)
    detail = f"workspace billing report: app {provider.target.app}, {len(mine)} daily row(s)"
    return SpendReport(name, AVAILABLE, usd, start, until, detail)


# --------------------------------------------------------------------------- cerebrium
def cerebrium_login_check(provider: Any) -> LoginCheck:
    """``GET {rest_url}/v2/projects/{project}/apps/{app_id}``: the app, read with the adapter's
    key from the management API that its cancels use (the read Cerebrium's own CLI makes to
    describe an app; the same path takes the documented ``PATCH``). Read-only: nothing runs.

    ok (2xx) proves the key is accepted there and that the app id cancels name exists. It does
    not prove the inference API (``api_url``) accepts the key: that API has no read-only call
    (every call runs the function, and bills), so a submit is the first to show it."""
    project, app_id = provider.project, provider.app_id
    path = f"/v2/projects/{quote(project, safe='')}/apps/{quote(app_id, safe='')}"
    what = f"GET {path}"

    def check(status: str, detail: str) -> LoginCheck:
        return LoginCheck(
            provider.name, status, f"{project}/{app_id}", scrub(detail, provider.secrets())
        )

    try:
        response = provider._http().get(f"{provider.rest_url}{path}")
    except Exception as e:
        return check(FAILED, no_answer(what, e))
    code = response.status_code
    if code in (401, 403):
        return check(FAILED, f"{what}: HTTP {code}: key refused")
    if code == 404:
        return check(
            FAILED,
            f"{what}: HTTP 404: no app {app_id!r} in project {project!r} "
            "(check project_id, app and app_id: cancels would fail)",
        )
    if code >= 300:
        return check(FAILED, f"{what}: HTTP {code}: {response.text[:120]}")
    try:
        body = response.json()
    except ValueError:
        body = None
    status = body.get("status") if isinstance(body, dict) else None
    found = f"app found (status {status})" if isinstance(status, str) and status else "app found"
    return check(OK, f"{what}: HTTP {code}: {found}")


def cerebrium_spend(provider: Any, since: float) -> SpendReport:
    return SpendReport(provider.name, UNAVAILABLE, None, since, detail=CEREBRIUM_NO_SPEND)
