"""The client side of the Modal stand-in: a namespace shaped like the ``modal`` package.

:class:`FakeModal` has the ``modal`` names the adapter uses (``Function.from_name``,
``Cls.from_name``, ``.spawn``, ``FunctionCall.from_id``, ``.get(timeout=)``,
``.cancel(terminate_containers=)``), with the real signatures (checked by
tests/test_modal_sdk_surface.py), speaks to the server of :mod:`tests.support.modal_fake`, and
raises the real ``modal.exception`` classes, the builtin ``TimeoutError`` while a call is not
ready, and a remote function's own exception, as modal 1.6 does. :func:`FakeModalClient` puts
the adapter's real :class:`~gpuhedge_celery.providers.modal_sdk.SdkModalClient` over it, so the
adapter's exception mapping runs unchanged. For tests and simulations only.
"""

from __future__ import annotations

import builtins
import os
from typing import Any


class FakeModal:
    """A namespace with the ``modal`` names the adapter uses, speaking to the fake server."""

    def __init__(self, url: str, timeout_s: float = 60.0):
        import httpx
        import modal.exception

        self.exception = modal.exception  # the real classes: the adapter maps these
        self._http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s)
        ns = self

        class Function:
            def __init__(self, target: str):
                self.target = target

            @classmethod
            def from_name(
                cls,
                app_name: str,
                name: str,
                *,
                version: int | None = None,
                environment_name: str | None = None,
                client: Any = None,
            ) -> Function:
                return cls(f"{app_name}/{name}")

            def hydrate(self, client: Any = None) -> Function:
                self.object_id = ns._call("GET", f"/v1/lookup/{self.target}")["object_id"]
                return self

            def spawn(self, *args: Any, **kwargs: Any) -> FunctionCall:
                body = {"target": self.target, "args": list(args), "kwargs": kwargs}
                data = ns._call("POST", "/v1/spawn", body)
                return FunctionCall(data["object_id"])

        class Cls:
            def __init__(self, app: str, name: str):
                self.app, self.name = app, name

            @classmethod
            def from_name(
                cls,
                app_name: str,
                name: str,
                *,
                version: int | None = None,
                environment_name: str | None = None,
                client: Any = None,
            ) -> Cls:
                return cls(app_name, name)

            def hydrate(self, client: Any = None) -> Cls:
                self.object_id = ns._call("GET", f"/v1/lookup/{self.app}/{self.name}")["object_id"]
                return self

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                outer = self

                class Obj:
                    def __getattr__(self, method: str) -> Function:
                        return Function(f"{outer.app}/{outer.name}.{method}")

                return Obj()

        class FunctionCall:
            def __init__(self, object_id: str):
                self.object_id = object_id

            @classmethod
            def from_id(cls, function_call_id: str, client: Any = None) -> FunctionCall:
                return cls(function_call_id)

            def get(self, timeout: float | None = None, *, index: int = 0) -> Any:
                data = ns._call("GET", f"/v1/calls/{self.object_id}")
                return ns._outcome(data)

            def cancel(self, terminate_containers: bool = False) -> None:
                ns._call("POST", f"/v1/calls/{self.object_id}/cancel",
                         {"terminate_containers": terminate_containers})  # fmt: skip

        class billing:  # noqa: N801 - the module's name
            @staticmethod
            def workspace_billing_report(
                *,
                start: Any,
                end: Any = None,
                resolution: str = "d",
                tag_names: list[str] | None = None,
                client: Any = None,
            ) -> list[dict[str, Any]]:
                from datetime import datetime, timezone
                from decimal import Decimal
                from urllib.parse import quote

                until = (end or datetime.now(timezone.utc)).isoformat()
                path = f"/v1/billing?start={quote(start.isoformat())}&end={quote(until)}"
                rows = ns._call("GET", path)
                for r in rows:  # typed as the real report: datetime and Decimal
                    r["interval_start"] = datetime.fromisoformat(r["interval_start"])
                    r["cost"] = Decimal(str(r["cost"]))
                    r.setdefault("tags", {})
                return rows

        self.Function, self.Cls, self.FunctionCall = Function, Cls, FunctionCall
        self.billing = billing

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        headers = {}
        for env, header in (("MODAL_TOKEN_ID", "x-modal-token-id"),
                            ("MODAL_TOKEN_SECRET", "x-modal-token-secret")):  # fmt: skip
            if os.environ.get(env):
                headers[header] = os.environ[env]
        response = self._http.request(method, path, json=body, headers=headers)
        try:
            data = response.json()
        except ValueError:
            raise self.exception.InternalError(f"bad reply {response.status_code}") from None
        if response.status_code >= 400:
            err = data.get("error") or {}
            cls = getattr(self.exception, str(err.get("type")), self.exception.InternalError)
            raise cls(str(err.get("message")))
        return data

    def _outcome(self, data: dict[str, Any]) -> Any:
        status = data.get("status")
        if status == "success":
            return data.get("output")
        if status == "pending":
            raise TimeoutError()  # as modal 1.6 raises it: the builtin
        if status == "expired":
            raise self.exception.OutputExpiredError()
        kind, message = str(data.get("type")), str(data.get("message"))
        # a modal error, else the function's own exception re-raised (a builtin one here)
        cls = getattr(self.exception, kind, None) or getattr(builtins, kind, None)
        raise (cls if isinstance(cls, type) else RuntimeError)(message)


def FakeModalClient(options: dict[str, Any]) -> Any:  # noqa: N802 - named like the class it makes
    """The adapter's seam (``sdk: "tests.support.modal_fake_sdk:FakeModalClient"``): the real SDK
    client over :class:`FakeModal`. Options: ``url`` of the fake server."""
    from gpuhedge_celery.providers.modal_sdk import SdkModalClient

    unknown = set(options) - {"url"}
    if unknown or not options.get("url"):
        raise ValueError(f"FakeModalClient takes {{url}}, got {sorted(options)}")
    return SdkModalClient(module=FakeModal(str(options["url"])))
