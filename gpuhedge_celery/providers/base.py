"""The provider contract: four methods every GPU backend implements, and shared helpers.

A provider runs one request as one job. Races talk to providers only through::

    submit(request: dict) -> JobHandle          # start the job; the handle is plain JSON data
    status(handle) -> JobState                  # cheap poll
    result(handle, cap_s) -> AttemptResult      # wait for terminal, right-censored at cap_s
    cancel(handle) -> CancelReceipt             # native cancel, confirmed by polling status

Handles carry everything needed to poll or cancel the job from another process, so a Celery
worker that did not submit the job (or a janitor after a crash) can rebuild the handle from
JSON, build the provider from config, and act on the same job.

The API is synchronous (Celery tasks are) and takes its time from an injected clock and sleep,
so tests drive it on a :class:`~gpuhedge_celery.core.clock.VirtualClock`.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from ..core.clock import Clock, VirtualClock, WallClock
from ..core.jobs import AttemptResult, JobHandle, JobState, LifecycleEvent
from ..core.receipts import CancelReceipt
from ..errors import ProviderProtocolError
from ..secrets import scrub_secrets
from .account import UNAVAILABLE, UNSUPPORTED, LoginCheck, SpendReport
from .options import Block

if TYPE_CHECKING:
    from .provider_config import ProviderConfig

Sleep = Callable[[float], None]

MAX_REPORTED_MS = 7 * 24 * 3600 * 1000.0  # longer than any provider lets one job run


def believable_ms(value: Any) -> bool:
    """Whether ``value`` is a duration a provider could have measured: a finite number of ms
    from 0 to :data:`MAX_REPORTED_MS` (not a bool)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value <= MAX_REPORTED_MS
    )


def reported_ms(provider: str, where: str, field: str, value: Any) -> float | None:
    """A duration a provider reported, in ms (None when it gave none).

    Anything but a finite number from 0 to :data:`MAX_REPORTED_MS` raises
    :class:`ProviderProtocolError`: a figure that cannot be true must not reach a receipt or
    the budget ledger."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProviderProtocolError(
            provider, f"{where}: field {field!r} is not a number of ms: {value!r}"[:200]
        )
    if not math.isfinite(value) or not 0 <= value <= MAX_REPORTED_MS:
        raise ProviderProtocolError(
            provider, f"{where}: field {field!r} is {value!r} ms, outside 0 to 7 days"[:200]
        )
    return float(value)


def cancel_note(refused: str, notes: Sequence[str]) -> str:
    """A cancel receipt's note: three notes at most, the latest of ``notes`` after ``refused``
    (the cancel call's own failure, "" when none), which failing confirming reads never push out:
    it is the only account of why a leaked job was not stopped."""
    return "; ".join([refused, *notes[-2:]] if refused else notes[-3:])


def default_sleep_for(clock: Clock) -> Sleep:
    """The sleep matching ``clock``: a virtual clock advances instead of blocking."""
    if isinstance(clock, VirtualClock):

        def advance(seconds: float) -> None:
            clock.advance(max(0.0, seconds))

        return advance
    return time.sleep


class Provider(abc.ABC):
    """One GPU backend (a serverless endpoint, a simulator, a self-hosted pool).

    Subclasses implement the four contract methods. Attributes used by races and cost reports:

    - ``name``: the provider's name in the config (and in every handle it issues);
    - ``billed_rate_per_s``: USD per second of execution (a worker running the job);
    - ``idle_billed_seconds``: seconds billed per worker start after the job ends (scale-down);
    - ``spends_money`` (class attribute): False only for adapters that never bill (the sim);
    - ``reports_queue_state`` (class attribute): False when the backend cannot tell queued from
      running; such a provider reports every unfinished job as ``IN_PROGRESS`` (the coarser,
      conservative truth: a running job costs money, a queued one does not), so a queue-state
      cutover can never be driven by it.
    """

    #: adapter type name used in config (``adapter: sim``); set by each subclass.
    adapter: ClassVar[str] = ""
    #: whether ``status`` can return ``QUEUED``; see the class docstring.
    reports_queue_state: ClassVar[bool] = True
    #: whether a job costs real money (a config naming such a provider needs a budget ceiling)
    spends_money: ClassVar[bool] = True
    #: whether ``webhook_result`` checks a delivery with an authenticated read of the provider
    #: (a delivery nobody checked ends its attempt but never proves a cancelled job stopped)
    delivery_is_verified: ClassVar[bool] = False

    def __init__(
        self,
        name: str,
        *,
        billed_rate_per_s: float = 0.0,
        idle_billed_seconds: float = 0.0,
        clock: Clock | None = None,
        sleep: Sleep | None = None,
    ):
        self.name = name
        self.billed_rate_per_s = float(billed_rate_per_s)
        self.idle_billed_seconds = float(idle_billed_seconds)
        # epoch seconds by default: handles are compared across processes and hosts
        self.clock: Clock = clock or WallClock()
        self.sleep: Sleep = sleep or default_sleep_for(self.clock)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    # --- configuration ----------------------------------------------------------------------

    @classmethod
    def parse_options(cls, block: Block, *, time_scale: float | None = None) -> Any:
        """Validate this adapter's YAML block (``providers.<name>.<adapter>``) at config load.

        Returns the parsed options handed back to :meth:`from_config` (an adapter-specific
        object). Unknown keys must be reported: call ``block.finish()``. The default accepts an
        empty block only.
        """
        block.finish()
        return None

    @classmethod
    def from_config(cls, cfg: ProviderConfig, **kwargs: Any) -> Provider:
        """Build the provider described by ``cfg`` (kwargs: ``clock``, ``sleep``, ``env``...)."""
        kwargs.pop("env", None)
        return cls(
            cfg.name,
            billed_rate_per_s=cfg.billed_rate_per_s,
            idle_billed_seconds=cfg.idle_billed_seconds,
            **kwargs,
        )

    # --- the contract -----------------------------------------------------------------------

    @abc.abstractmethod
    def submit(self, request: dict[str, Any]) -> JobHandle:
        """Start ``request`` as a new job and return its handle (raises ``SubmitError``)."""

    @abc.abstractmethod
    def status(self, handle: JobHandle) -> JobState:
        """The job's current state, cheaply (raises ``ProviderError`` when it cannot tell)."""

    @abc.abstractmethod
    def result(self, handle: JobHandle, cap_s: float) -> AttemptResult:
        """Wait until the job is terminal or ``cap_s`` after its submit time, whichever is first.

        Never raises for slowness: at the cap the answer is an ``AttemptResult`` in state
        ``TIMEOUT`` (the job itself is left alone; cancelling is the caller's decision).
        Returns at once when the job is already terminal.
        """

    @abc.abstractmethod
    def cancel(self, handle: JobHandle) -> CancelReceipt:
        """Cancel the job natively and confirm it by polling status to a terminal state.

        The receipt states only what was observed: evidence, scope and ``leaked`` start
        conservative (``no_evidence``, leaked) and are upgraded by observations alone.
        """

    # --- account hooks (optional; see providers/account.py) ---------------------------------

    def login_check(self) -> LoginCheck:
        """One read-only authenticated call: who we are, or why not. Never shows a secret."""
        return LoginCheck(self.name, UNSUPPORTED, "", f"the {self.adapter} adapter has no check")

    def reported_spend(self, since: float) -> SpendReport:
        """The spend the provider's billing reports since ``since`` (UTC epoch s), or why not."""
        detail = f"the {self.adapter} adapter reads no billing API"
        return SpendReport(self.name, UNAVAILABLE, None, since, detail=detail)

    # --- helpers for subclasses and callers -------------------------------------------------

    def secrets(self) -> tuple[str, ...]:
        """The credentials this provider holds (keys, tokens, secret header values): never
        in any text it returns. Adapters that hold one override this."""
        return ()

    def scrub(self, text: str) -> str:
        """``text`` with every one of :meth:`secrets` masked: every error, note and echoed
        job message an adapter keeps passes here."""
        return scrub_secrets(text, self.secrets())

    def now_ms(self) -> float:
        """The provider clock in milliseconds (receipt times)."""
        return self.clock.now() * 1000.0

    def elapsed_ms(self, handle: JobHandle) -> float:
        """Milliseconds since ``handle`` was submitted, on this provider's clock."""
        return (self.clock.now() - handle.submitted_at) * 1000.0

    def deadline(self, handle: JobHandle, cap_s: float) -> float:
        """The clock reading at which ``result(handle, cap_s)`` gives up."""
        return handle.submitted_at + float(cap_s)

    def cost_usd(self, execution_s: float) -> float:
        """Active cost of ``execution_s`` seconds of execution at this provider's rate."""
        return max(0.0, execution_s) * self.billed_rate_per_s

    def timeout_result(
        self, handle: JobHandle, cap_s: float, events: list[LifecycleEvent], **metrics: Any
    ) -> AttemptResult:
        """The right-censored answer at the cap (``TIMEOUT``, wall time = the cap)."""
        events = [*events, LifecycleEvent(cap_s * 1000.0, "timeout", f"no result by {cap_s} s")]
        return AttemptResult(
            provider=self.name,
            job_id=handle.job_id,
            state=JobState.TIMEOUT,
            wall_ms=cap_s * 1000.0,
            metrics=dict(metrics),
            events=events,
            error=f"right-censored at the {cap_s} s cap",
        )

    def check_handle(self, handle: JobHandle) -> None:
        """Refuse a handle issued by another provider (a mix-up would poll the wrong job)."""
        if handle.provider != self.name:
            raise ValueError(f"handle of provider {handle.provider!r} given to {self.name!r}")


# Optional capabilities a provider may have beside the contract above; the race's watch and
# the webhook receiver check for each with isinstance.


@runtime_checkable
class HintsNextChange(Protocol):
    """A provider that knows when a job's state may next change: its watch polls then rather
    than on the watch interval (None: no idea)."""

    def next_change_at(self, handle: JobHandle) -> float | None: ...


@runtime_checkable
class PollsWithHint(Protocol):
    """A provider whose one look answers a job's state and when to look again (one call
    instead of :meth:`Provider.status` and :meth:`HintsNextChange.next_change_at`).
    ``reserved``: the request slot a rate-limited provider reserved when it deferred this poll
    (``RateLimited.reserved``), handed back to be spent; only that provider is given one."""

    def status_and_next_change(
        self, handle: JobHandle, reserved: float | None = None
    ) -> tuple[JobState, float | None]: ...


@runtime_checkable
class PollsMany(Protocol):
    """A provider that answers many jobs' states in one look (the batched watch loop)."""

    def status_and_next_change_many(
        self, handles: list[JobHandle]
    ) -> list[tuple[JobState, float | None]]: ...


@runtime_checkable
class TakesWebhooks(Protocol):
    """A provider that pushes a job's end to the webhook receiver: the body a delivery carries,
    parsed into the job's result (None: not ended yet)."""

    def webhook_result(self, handle: JobHandle, body: Any) -> AttemptResult | None: ...


@runtime_checkable
class CancelsBehindQueued(Protocol):
    """A provider whose cancels share a rate-limited route: the cancel of a job seen running
    can wait behind the cancels of queued jobs (a queued job stopped now costs nothing, a
    running one only its next seconds)."""

    def cancel_running(self, handle: JobHandle) -> CancelReceipt: ...
