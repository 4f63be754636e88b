"""The installed ``modal`` package still has every name and parameter the adapter uses.

Nothing here contacts Modal: signatures, classes and the source of the poll are inspected, so
an SDK release that renames or reshapes any of them fails CI before it fails a race. The
stand-in (tests/support/modal_fake_sdk.py) is checked against the same names, so the adapter's
tests exercise the surface the real SDK offers.
"""

from __future__ import annotations

import builtins
import inspect

import modal
import modal.exception as mx
import pytest

from gpuhedge_celery.providers import modal_sdk
from gpuhedge_celery.providers.modal_sdk import (
    EXPIRED,
    FAILED,
    PENDING,
    ModalSdkError,
    SdkModalClient,
    classify,
)


def params(fn) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


@pytest.mark.parametrize("owner", [modal.Function, modal.Cls])
def test_from_name_takes_app_name_and_environment(owner):
    p = params(owner.from_name)
    names = [n for n, q in p.items() if q.kind is q.POSITIONAL_OR_KEYWORD]
    assert names[:2] == ["app_name", "name"]  # called positionally: from_name(app, name)
    assert "environment_name" in p and p["environment_name"].default is None


def test_spawn_takes_the_request_as_one_positional_argument():
    p = params(modal.Function.spawn)
    assert any(q.kind is q.VAR_POSITIONAL for q in p.values())


def test_function_call_from_id_get_cancel_and_object_id():
    fc = modal.FunctionCall
    assert "function_call_id" in params(fc.from_id)
    get = params(fc.get)
    assert "timeout" in get and get["timeout"].kind is get["timeout"].POSITIONAL_OR_KEYWORD
    cancel = params(fc.cancel)
    assert "terminate_containers" in cancel and cancel["terminate_containers"].default is False
    assert isinstance(inspect.getattr_static(fc, "object_id"), property)


def test_hydrate_and_the_workspace_billing_report():
    """``login-check`` resolves the function (``hydrate``); ``costs`` reads the workspace
    billing report: keyword ``start``/``end``/``resolution``, rows with description, environment,
    interval start and a Decimal cost."""
    for owner in (modal.Function, modal.Cls):
        assert list(params(owner.hydrate)) == ["self", "client"]
    report = params(modal.billing.workspace_billing_report)
    assert all(report[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ("start", "end"))
    assert report["resolution"].default == "d" and report["end"].default is None
    from modal._billing import WorkspaceBillingReportItem

    fields = WorkspaceBillingReportItem.__annotations__
    assert {"description", "environment_name", "interval_start", "cost"} <= set(fields)


def test_exception_classes_and_the_hierarchy_the_mapping_relies_on():
    for name in ("OutputExpiredError", "FunctionTimeoutError", "RemoteError", "InternalFailure",
                 "ExecutionError", "TimeoutError", "Error", "InputCancellation",
                 "NotFoundError", "AuthError"):  # fmt: skip
        assert isinstance(getattr(mx, name), type), name
    # both are modal TimeoutErrors: classify must test them before "not ready"
    assert issubclass(mx.OutputExpiredError, mx.TimeoutError)
    assert issubclass(mx.FunctionTimeoutError, mx.TimeoutError)
    assert not issubclass(mx.InputCancellation, Exception)  # a BaseException: caught by name
    assert issubclass(mx.RemoteError, mx.Error) and issubclass(mx.NotFoundError, mx.Error)


def test_get_raises_the_builtin_timeout_error_while_not_ready():
    """``get(timeout=0)`` on an unfinished call raises ``TimeoutError()``: in modal 1.6 the
    builtin one (poll_function in modal._functions), expired output ``OutputExpiredError``."""
    from modal import _functions

    source = inspect.getsource(_functions._Invocation.poll_function)
    assert "raise TimeoutError()" in source and "raise OutputExpiredError()" in source
    assert vars(_functions).get("TimeoutError", builtins.TimeoutError) in (
        builtins.TimeoutError,
        mx.TimeoutError,
    )


@pytest.mark.parametrize(
    "exc, state, kind",
    [
        (builtins.TimeoutError(), PENDING, None),
        (mx.TimeoutError("old SDKs"), PENDING, None),
        (mx.OutputExpiredError(), EXPIRED, None),
        (mx.FunctionTimeoutError("took too long"), FAILED, "function_timeout"),
        (mx.RemoteError("crashed"), FAILED, "remote_error"),
        (mx.InternalFailure("oops"), FAILED, "internal_failure"),
        (mx.ExecutionError("cannot deserialize"), FAILED, "remote_error"),
        (ValueError("the function's own"), FAILED, "user_exception"),
        (KeyError("x"), FAILED, "user_exception"),
    ],
)
def test_classify_real_exceptions(exc, state, kind):
    outcome = classify(exc, mx)
    assert (outcome.state, outcome.kind) == (state, kind)


@pytest.mark.parametrize(
    "exc",
    [
        mx.NotFoundError("no call"),
        mx.AuthError("bad token"),
        mx.ConnectionError("down"),
        mx.InternalError("server"),
        ConnectionRefusedError("refused"),
    ],  # fmt: skip
)
def test_classify_transport_errors_as_failed_calls_not_failed_jobs(exc):
    with pytest.raises(ModalSdkError):
        classify(exc, mx)


def test_the_real_client_uses_only_these_names():
    """Every ``m.<name>`` the real client touches is in this file's checks above."""
    source = inspect.getsource(SdkModalClient) + inspect.getsource(modal_sdk.classify)
    used = {
        "m.Cls.from_name", "m.Function.from_name", "m.FunctionCall.from_id",
        "m.billing.workspace_billing_report", ".hydrate()",
        "m.exception.InputCancellation", ".spawn(", ".get(timeout=0)",
        ".cancel(terminate_containers=False)", "call.object_id",
        "exceptions.OutputExpiredError", "exceptions.FunctionTimeoutError",
        "exceptions.TimeoutError", "exceptions.InternalFailure", "exceptions.RemoteError",
        "exceptions.ExecutionError",
    }  # fmt: skip
    for name in used:
        assert name in source, name
    import re

    touched = set(re.findall(r"\bm\.[A-Za-z_.]+", source)) | set(
        re.findall(r"\bexceptions\.[A-Za-z_]+", source)
    )
    checked = {n.rstrip("(") for n in used if n.startswith(("m.", "exceptions."))}
    assert touched <= checked | {"m.exception"}, touched - checked


def test_the_stand_in_mirrors_the_real_signatures():
    from tests.support.modal_fake_sdk import FakeModal

    fake = FakeModal("http://127.0.0.1:9")  # no request is made
    pairs = [
        (fake.Function.from_name, modal.Function.from_name),
        (fake.Cls.from_name, modal.Cls.from_name),
        (fake.FunctionCall.from_id, modal.FunctionCall.from_id),
        (fake.FunctionCall.get, modal.FunctionCall.get),
        (fake.FunctionCall.cancel, modal.FunctionCall.cancel),
        (fake.Function.hydrate, modal.Function.hydrate),
        (fake.Cls.hydrate, modal.Cls.hydrate),
        (fake.billing.workspace_billing_report, modal.billing.workspace_billing_report),
    ]
    for mine, real in pairs:
        real_params = {n: (q.kind, q.default) for n, q in params(real).items() if n != "cls"}
        my_params = {n: (q.kind, q.default) for n, q in params(mine).items() if n != "cls"}
        assert my_params == real_params, (mine, real)
    assert fake.exception is mx
