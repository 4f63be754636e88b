"""The one seam between the ``modal`` adapter and Modal's Python SDK, and its real side.

The adapter (:mod:`gpuhedge_celery.providers.modal`) talks to Modal only through a
:class:`ModalClient`: three blocking calls on plain data::

    spawn(target, request) -> call id        # Function.from_name(...).spawn(request)
    poll(call_id) -> Outcome                 # FunctionCall.from_id(id).get(timeout=0)
    cancel(call_id) -> None                  # FunctionCall.from_id(id).cancel()

:class:`SdkModalClient` is the real implementation and the only code that imports ``modal``
(lazily, when a modal provider is first used), so a user without the ``[modal]`` extra never
loads it. It works over any namespace shaped like the ``modal`` package; the tests' stand-in
(``tests/support/modal_fake_sdk.py``) hands it one that speaks to a loopback server, so the
exception mapping below is exercised by every test, and ``tests/test_modal_sdk_surface.py``
checks each name used here against the installed package.

What ``get(timeout=0)`` tells (modal 1.6, checked by that test):

- returns: the output;
- builtin ``TimeoutError`` (``modal.exception.TimeoutError`` in older releases): not ready,
  queued or running (Modal does not say which);
- ``OutputExpiredError`` (a ``modal.exception.TimeoutError``): no output and no unfinished
  input: the input is over, its outcome unknown (a cancelled input, an expired result);
- ``FunctionTimeoutError``, ``RemoteError``, ``InternalFailure``, ``ExecutionError`` or the
  function's own exception, re-raised here: the input failed;
- any other ``modal``/``grpclib`` error or an ``OSError``: the call itself failed (network,
  auth, an unknown id): :class:`ModalSdkError`, never a verdict on the job.

:class:`BoundedCalls` runs those blocking calls on a few daemon threads with a deadline, so a
hung SDK call never holds a race's timer thread (nor the interpreter's exit).
"""

from __future__ import annotations

import importlib.util
import os
import queue
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..errors import ConfigError

T = TypeVar("T")

INSTALL_HINT = "the modal adapter needs the 'modal' package: pip install 'gpuhedge-celery[modal]'"

PENDING = "pending"  # not ready: queued or running
COMPLETED = "completed"  # returned an output
FAILED = "failed"  # raised remotely (kind says how)
EXPIRED = "expired"  # no output and no unfinished input: over, outcome unknown

#: error classes that come from the SDK's own machinery (the call failed, not the function)
_TRANSPORT_MODULES = frozenset(
    {"modal", "modal_proto", "grpclib", "synchronicity", "asyncio", "aiohttp", "h2", "httpx"}
)


def modal_available() -> bool:
    """Whether ``import modal`` can work here, without importing it (config load stays cheap)."""
    if "modal" in sys.modules:
        return sys.modules["modal"] is not None
    try:
        return importlib.util.find_spec("modal") is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class ModalTarget:
    """What to spawn: ``app``'s function, or ``app``'s class ``cls`` and its ``method``."""

    app: str
    function: str | None = None
    cls: str | None = None
    method: str | None = None
    environment: str | None = None

    @property
    def label(self) -> str:
        name = f"{self.cls}.{self.method}" if self.cls else str(self.function)
        return f"{self.app}/{name}"


@dataclass(frozen=True)
class Outcome:
    """One poll of a call: ``state`` is PENDING, COMPLETED, FAILED or EXPIRED.

    ``output``: the function's return value (COMPLETED). ``error``: one line (FAILED, EXPIRED).
    ``kind``: how it failed: ``function_timeout``, ``remote_error``, ``internal_failure``,
    ``cancelled`` (the input was cancelled) or ``user_exception`` (the function raised).
    """

    state: str
    output: Any = None
    error: str | None = None
    kind: str | None = None


class ModalSdkError(Exception):
    """An SDK call failed (network, auth, unknown app or call id): nothing is known of the job."""


class ModalClient(Protocol):
    """The seam: what the adapter needs from Modal. Implementations must be thread-safe."""

    def spawn(self, target: ModalTarget, request: dict[str, Any]) -> str:
        """Spawn one call of ``target`` with the request as its one argument; its call id."""

    def poll(self, call_id: str) -> Outcome:
        """The call's state now, without waiting (raises ModalSdkError when the poll fails)."""

    def cancel(self, call_id: str) -> None:
        """Cancel the call's input (raises ModalSdkError when the call fails)."""

    # Optional (``login-check``, ``costs``): a seam without them reports "unsupported".
    # lookup(target) -> str               the deployed object's id (an authenticated read)
    # billing(start, end) -> list[dict]   the workspace billing report, daily rows


def describe(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def classify(exc: Exception, exceptions: Any) -> Outcome:
    """Map what ``FunctionCall.get(timeout=0)`` raised to an :class:`Outcome`.

    ``exceptions`` is the SDK's ``modal.exception`` module. The order matters: the expiry and
    the function's timeout are ``modal.exception.TimeoutError`` subclasses, and a builtin
    ``TimeoutError`` (not ready) is an ``OSError``. Raises :class:`ModalSdkError` when the poll
    itself failed.
    """
    if isinstance(exc, exceptions.OutputExpiredError):
        return Outcome(EXPIRED, error=describe(exc))
    if isinstance(exc, exceptions.FunctionTimeoutError):
        return Outcome(FAILED, error=describe(exc), kind="function_timeout")
    if isinstance(exc, (TimeoutError, exceptions.TimeoutError)):
        return Outcome(PENDING)
    if isinstance(exc, exceptions.InternalFailure):
        return Outcome(FAILED, error=describe(exc), kind="internal_failure")
    if isinstance(exc, (exceptions.RemoteError, exceptions.ExecutionError)):
        return Outcome(FAILED, error=describe(exc), kind="remote_error")
    if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in _TRANSPORT_MODULES:
        raise ModalSdkError(describe(exc)) from None
    return Outcome(FAILED, error=describe(exc), kind="user_exception")  # the function raised


class SdkModalClient:
    """The real :class:`ModalClient`, over the ``modal`` package (or a namespace shaped like it).

    Auth is the SDK's own: ``MODAL_TOKEN_ID`` / ``MODAL_TOKEN_SECRET`` in the environment (or
    ``~/.modal.toml``); this class never reads or logs them. Function handles are looked up
    once per process (``from_name`` is lazy; the first spawn resolves it).
    """

    def __init__(self, options: Mapping[str, Any] | None = None, *, module: Any = None):
        if options:
            raise ConfigError(f"the Modal SDK client takes no options, got {sorted(options)}")
        self._module = module
        self._lock = threading.Lock()
        self._functions: dict[ModalTarget, Any] = {}
        self._pid = os.getpid()

    def _modal(self) -> Any:
        if self._module is None:
            try:
                import modal  # the one import of the SDK
            except ImportError:
                raise ConfigError(INSTALL_HINT) from None
            self._module = modal
        return self._module

    def _function(self, target: ModalTarget) -> Any:
        with self._lock:
            if self._pid != os.getpid():  # a forked child must not reuse its parent's handles
                self._functions, self._pid = {}, os.getpid()
            found = self._functions.get(target)
        if found is not None:
            return found
        m = self._modal()
        try:
            if target.cls:
                cls = m.Cls.from_name(target.app, target.cls, environment_name=target.environment)
                found = getattr(cls(), str(target.method))
            else:
                found = m.Function.from_name(
                    target.app, str(target.function), environment_name=target.environment
                )
        except Exception as e:
            raise ModalSdkError(f"lookup of {target.label}: {describe(e)}") from None
        with self._lock:
            self._functions[target] = found
        return found

    def spawn(self, target: ModalTarget, request: dict[str, Any]) -> str:
        function = self._function(target)
        try:
            call = function.spawn(request)
        except Exception as e:
            raise ModalSdkError(f"spawn of {target.label}: {describe(e)}") from None
        return str(call.object_id)

    def poll(self, call_id: str) -> Outcome:
        m = self._modal()
        try:
            output = m.FunctionCall.from_id(call_id).get(timeout=0)
        except m.exception.InputCancellation as e:  # a BaseException, re-raised from remote
            return Outcome(FAILED, error=describe(e), kind="cancelled")
        except Exception as e:
            return classify(e, m.exception)
        return Outcome(COMPLETED, output=output)

    def cancel(self, call_id: str) -> None:
        m = self._modal()
        try:
            # Input-granular. terminate_containers=True was rejected server-side in practice.
            m.FunctionCall.from_id(call_id).cancel(terminate_containers=False)
        except Exception as e:
            raise ModalSdkError(f"cancel: {describe(e)}") from None

    def lookup(self, target: ModalTarget) -> str:
        """Resolve the target on Modal (``hydrate``): one authenticated read; its object id."""
        m = self._modal()
        try:
            if target.cls:
                found = m.Cls.from_name(target.app, target.cls, environment_name=target.environment)
            else:
                found = m.Function.from_name(
                    target.app, str(target.function), environment_name=target.environment
                )
            return str(found.hydrate().object_id)
        except Exception as e:
            raise ModalSdkError(f"lookup of {target.label}: {describe(e)}") from None

    def billing(self, start: Any, end: Any) -> list[dict[str, Any]]:
        """The workspace billing report between ``start`` and ``end`` (UTC datetimes), in
        daily rows ``{description, environment_name, interval_start, cost}`` (cost: float
        USD). Modal reports full days only: a partial last day is left out."""
        m = self._modal()
        try:
            rows = m.billing.workspace_billing_report(start=start, end=end, resolution="d")
        except Exception as e:
            raise ModalSdkError(f"billing report: {describe(e)}") from None
        return [
            {
                "description": str(r.get("description", "")),
                "environment_name": str(r.get("environment_name", "")),
                "interval_start": r.get("interval_start"),
                "cost": float(r.get("cost", 0)),
            }
            for r in rows
        ]


class SdkCallTimeout(Exception):
    """A bounded SDK call did not finish in time. ``started``: it had begun (its effect, a
    spawn's call for one, may still happen); else it never ran and never will."""

    def __init__(self, what: str, timeout_s: float, started: bool):
        self.what, self.timeout_s, self.started = what, timeout_s, started
        state = "did not answer" if started else "did not start (every SDK thread busy)"
        super().__init__(f"{what} {state} within {timeout_s:g} s")


class BoundedCalls:
    """Blocking calls on ``threads`` daemon threads, each waited for at most its timeout.

    A call still queued at its deadline is withdrawn (it never runs); one already running is
    left to finish on its thread, and ``on_late`` gets its future when it does. Daemon
    threads: a call hung in the SDK never blocks the worker's shutdown. Threads are started on
    first use in each process (they do not survive a fork).
    """

    def __init__(self, threads: int, name: str = "gpuhedge-modal"):
        self.threads = max(1, int(threads))
        self.name = name
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] | None = None
        self._pid: int | None = None

    def _work_queue(self) -> queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]]:
        with self._lock:
            if self._queue is None or self._pid != os.getpid():
                self._queue, self._pid = queue.SimpleQueue(), os.getpid()
                for i in range(self.threads):
                    threading.Thread(
                        target=_serve, args=(self._queue,), name=f"{self.name}-{i}", daemon=True
                    ).start()
            return self._queue

    def run(
        self,
        fn: Callable[[], T],
        timeout_s: float,
        what: str,
        on_late: Callable[[Future[Any]], None] | None = None,
    ) -> T:
        """``fn()``'s result or exception, or :class:`SdkCallTimeout` after ``timeout_s``."""
        future: Future[Any] = Future()
        self._work_queue().put((future, fn))
        try:
            return future.result(timeout=max(0.0, timeout_s))
        except FuturesTimeout:
            if future.cancel():
                raise SdkCallTimeout(what, timeout_s, started=False) from None
            if future.done():  # finished between the deadline and now
                return future.result()
            if on_late is not None:
                future.add_done_callback(on_late)
            raise SdkCallTimeout(what, timeout_s, started=True) from None


def _serve(work: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]]) -> None:
    while True:
        future, fn = work.get()
        if not future.set_running_or_notify_cancel():
            continue  # withdrawn at its deadline before it started
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(e)
