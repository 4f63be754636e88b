"""Built-in hedging policies and their names: single, fixed hedge, cutover, cascade.

Names (``parse_policy``): ``single:P``, ``hedge:P->H@Ds``, ``cutover:P->H@qQs+sSs``,
``cascade:P->H->F@qQs+sSs+eEs`` (durations in ``s`` or ``ms``; omitted timings take the
defaults). ``fixed:`` and ``state_aware:`` are accepted aliases. Every built-in is written against
the same :class:`~gpuhedge_celery.core.policy_base.Policy` interface a custom policy uses.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from ..errors import ConfigError
from .jobs import JobState
from .policy_base import (
    _REGISTRY,
    DURATION_RE,
    FALLBACK,
    HEDGE,
    PRIMARY,
    PROVIDER_RE,
    AttemptView,
    Policy,
    RaceControl,
    bad_name,
    check_ms,
    duration_ms,
    fmt_s,
    register_policy,
    registered_policies,
)

__all__ = [
    "FALLBACK",
    "HEDGE",
    "PRIMARY",
    "AttemptView",
    "CascadePolicy",
    "FixedHedgePolicy",
    "Policy",
    "RaceControl",
    "SinglePolicy",
    "StateAwarePolicy",
    "fmt_s",
    "parse_policy",
    "policy_from_dict",
    "register_policy",
    "registered_policies",
]


def parse_policy(text: str) -> Policy:
    """Parse a policy name such as ``hedge:runpod->cerebrium@10s``; bad input is a ConfigError."""
    if not isinstance(text, str) or ":" not in text:
        raise ConfigError(f"bad policy name {text!r}: expected KIND:ARGS, e.g. single:runpod")
    kind, body = text.strip().split(":", 1)
    cls = _REGISTRY.get(kind.strip())
    if cls is None:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigError(f"unknown policy kind {kind!r} in {text!r} (known: {known})")
    return cls.parse(body.strip())


def policy_from_dict(data: dict[str, Any]) -> Policy:
    """Rebuild a policy from :meth:`Policy.to_dict` output."""
    cls = _REGISTRY.get(data.get("kind", ""))
    if cls is None:
        raise ConfigError(f"unknown policy kind {data.get('kind')!r}")
    return cls(**data.get("params", {}))


# --------------------------------------------------------------------------- built-ins


@register_policy
class SinglePolicy(Policy):
    """One provider, no hedge: the baseline."""

    kind = "single"

    def __init__(self, primary: str):
        self.primary = primary

    def providers(self) -> tuple[str, ...]:
        return (self.primary,)

    @property
    def name(self) -> str:
        return f"single:{self.primary}"

    def params(self) -> dict[str, Any]:
        return {"primary": self.primary}

    @classmethod
    def parse(cls, body: str) -> Policy:
        if not re.fullmatch(PROVIDER_RE, body):
            raise bad_name("single", body, "PROVIDER")
        return cls(body)


@register_policy
class FixedHedgePolicy(Policy):
    """Launch the hedge if the primary has no valid result ``hedge_after_ms`` after its submit.

    An invalid or failed primary before then launches the hedge at once; ``hedge_after_ms=0``
    launches both at the start (an immediate race).
    """

    kind = "hedge"
    aliases: ClassVar[tuple[str, ...]] = ("fixed",)

    def __init__(self, primary: str, hedge: str, hedge_after_ms: int = 10_000):
        self.primary = primary
        self.hedge = hedge
        self.hedge_after_ms = check_ms(hedge_after_ms, "hedge_after_ms")

    def providers(self) -> tuple[str, ...]:
        return (self.primary, self.hedge)

    @property
    def name(self) -> str:
        return f"hedge:{self.primary}->{self.hedge}@{fmt_s(self.hedge_after_ms)}s"

    def params(self) -> dict[str, Any]:
        return {"primary": self.primary, "hedge": self.hedge, "hedge_after_ms": self.hedge_after_ms}

    @classmethod
    def parse(cls, body: str) -> Policy:
        m = re.fullmatch(rf"({PROVIDER_RE})->({PROVIDER_RE})(?:@{DURATION_RE})?", body)
        if not m:
            raise bad_name("hedge", body, "PRIMARY->HEDGE@Ds")
        after = duration_ms(m.group(3), m.group(4)) if m.group(3) else 10_000
        return cls(m.group(1), m.group(2), after)

    def _launch_hedge(self, ctl: RaceControl) -> None:
        if not ctl.state.get("hedge_requested"):
            ctl.state["hedge_requested"] = True
            ctl.clear_timer("hedge")
            ctl.launch(self.hedge, HEDGE)

    def on_start(self, ctl: RaceControl) -> None:
        ctl.launch(self.primary, PRIMARY)
        if self.hedge_after_ms == 0:
            self._launch_hedge(ctl)

    def on_submitted(self, ctl: RaceControl, attempt: AttemptView) -> None:
        if attempt.role == PRIMARY and not ctl.state.get("hedge_requested"):
            ctl.set_timer("hedge", self.hedge_after_ms / 1000)

    def on_timer(self, ctl: RaceControl, key: str) -> None:
        if key == "hedge":
            self._launch_hedge(ctl)

    def on_failed(self, ctl: RaceControl, attempt: AttemptView) -> None:
        if attempt.role == PRIMARY:
            self._launch_hedge(ctl)


@register_policy
class StateAwarePolicy(Policy):
    """Queue-state cutover: poll the primary at ``queue_cutover_ms``; if still QUEUED, cancel it
    (its worker never started) and launch the hedge; otherwise keep it and launch the hedge at
    ``safety_hedge_ms`` if there is still no valid result."""

    kind = "cutover"
    aliases: ClassVar[tuple[str, ...]] = ("state_aware",)

    def __init__(
        self,
        primary: str,
        hedge: str,
        queue_cutover_ms: int = 2_500,
        safety_hedge_ms: int = 8_500,
    ):
        self.primary = primary
        self.hedge = hedge
        self.queue_cutover_ms = check_ms(queue_cutover_ms, "queue_cutover_ms")
        self.safety_hedge_ms = check_ms(safety_hedge_ms, "safety_hedge_ms")
        if self.safety_hedge_ms < self.queue_cutover_ms:
            raise ConfigError(
                f"safety_hedge_ms ({self.safety_hedge_ms}) must not be before "
                f"queue_cutover_ms ({self.queue_cutover_ms})"
            )

    def providers(self) -> tuple[str, ...]:
        return (self.primary, self.hedge)

    def _times(self) -> str:
        return f"q{fmt_s(self.queue_cutover_ms)}s+s{fmt_s(self.safety_hedge_ms)}s"

    @property
    def name(self) -> str:
        return f"cutover:{self.primary}->{self.hedge}@{self._times()}"

    def params(self) -> dict[str, Any]:
        return {
            "primary": self.primary,
            "hedge": self.hedge,
            "queue_cutover_ms": self.queue_cutover_ms,
            "safety_hedge_ms": self.safety_hedge_ms,
        }

    @classmethod
    def parse(cls, body: str) -> Policy:
        pattern = rf"({PROVIDER_RE})->({PROVIDER_RE})(?:@q{DURATION_RE}\+s{DURATION_RE})?"
        m = re.fullmatch(pattern, body)
        if not m:
            raise bad_name("cutover", body, "PRIMARY->HEDGE@qQs+sSs")
        if not m.group(3):
            return cls(m.group(1), m.group(2))
        g = m.groups()
        return cls(g[0], g[1], duration_ms(g[2], g[3]), duration_ms(g[4], g[5]))

    def _launch_hedge(self, ctl: RaceControl) -> None:
        if not ctl.state.get("hedge_requested"):
            ctl.state["hedge_requested"] = True
            ctl.clear_timer("cutover")
            ctl.clear_timer("safety")
            ctl.launch(self.hedge, HEDGE)

    def on_submitted(self, ctl: RaceControl, attempt: AttemptView) -> None:
        if attempt.role == PRIMARY and not ctl.state.get("hedge_requested"):
            ctl.set_timer("cutover", self.queue_cutover_ms / 1000)
            ctl.set_timer("safety", self.safety_hedge_ms / 1000)

    def on_timer(self, ctl: RaceControl, key: str) -> None:
        if key == "cutover" and not ctl.state.get("hedge_requested"):
            primary = ctl.attempt_for(PRIMARY)
            if primary is not None and primary.live:
                ctl.state["cutover_poll"] = primary.id
                ctl.poll(primary.id)
        elif key == "safety":
            self._launch_hedge(ctl)

    def on_status(
        self, ctl: RaceControl, attempt: AttemptView, state: JobState | None, error: str | None
    ) -> None:
        # Only the answer to our own single cutover poll decides; other polls are just recorded.
        if ctl.state.get("cutover_poll") != attempt.id:
            return
        ctl.state["cutover_poll"] = None
        if state is JobState.QUEUED and error is None and not ctl.state.get("hedge_requested"):
            ctl.flag("cut_over")
            ctl.cancel(attempt.id, "cutover: still queued")
            self._launch_hedge(ctl)
        # Any other answer (running, unknown, poll error): keep the primary; the safety timer
        # launches the hedge later if it is still needed.

    def on_failed(self, ctl: RaceControl, attempt: AttemptView) -> None:
        if attempt.role == PRIMARY:
            self._launch_hedge(ctl)


@register_policy
class CascadePolicy(StateAwarePolicy):
    """State-aware cutover plus a third provider at ``escalate_after_ms``, or at once when every
    attempt ended without a valid result; only while a live slot is free (the engine makes it
    wait and retries whenever a job ends). The fallback is launched at most once."""

    kind = "cascade"
    aliases: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        primary: str,
        hedge: str,
        fallback: str,
        queue_cutover_ms: int = 2_500,
        safety_hedge_ms: int = 8_500,
        escalate_after_ms: int = 25_000,
    ):
        super().__init__(primary, hedge, queue_cutover_ms, safety_hedge_ms)
        self.fallback = fallback
        self.escalate_after_ms = check_ms(escalate_after_ms, "escalate_after_ms")

    def providers(self) -> tuple[str, ...]:
        return (self.primary, self.hedge, self.fallback)

    @property
    def name(self) -> str:
        return (
            f"cascade:{self.primary}->{self.hedge}->{self.fallback}"
            f"@{self._times()}+e{fmt_s(self.escalate_after_ms)}s"
        )

    def params(self) -> dict[str, Any]:
        return {
            **super().params(),
            "fallback": self.fallback,
            "escalate_after_ms": self.escalate_after_ms,
        }

    @classmethod
    def parse(cls, body: str) -> Policy:
        m = re.fullmatch(
            rf"({PROVIDER_RE})->({PROVIDER_RE})->({PROVIDER_RE})"
            rf"(?:@q{DURATION_RE}\+s{DURATION_RE}\+e{DURATION_RE})?",
            body,
        )
        if not m:
            raise bad_name("cascade", body, "PRIMARY->HEDGE->FALLBACK@qQs+sSs+eEs")
        g = m.groups()
        if not g[3]:
            return cls(g[0], g[1], g[2])
        cut, safety, escalate = (duration_ms(g[i], g[i + 1]) for i in (3, 5, 7))
        return cls(g[0], g[1], g[2], cut, safety, escalate)

    def _escalate(self, ctl: RaceControl) -> None:
        if not ctl.state.get("fallback_requested"):
            ctl.state["fallback_requested"] = True
            ctl.clear_timer("escalate")
            ctl.launch(self.fallback, FALLBACK)

    def on_submitted(self, ctl: RaceControl, attempt: AttemptView) -> None:
        super().on_submitted(ctl, attempt)
        if attempt.role == PRIMARY and not ctl.state.get("fallback_requested"):
            ctl.set_timer("escalate", self.escalate_after_ms / 1000)

    def on_timer(self, ctl: RaceControl, key: str) -> None:
        if key == "escalate":
            self._escalate(ctl)
        else:
            super().on_timer(ctl, key)

    def on_idle(self, ctl: RaceControl) -> None:
        self._escalate(ctl)


# The adaptive kind lives in its own module (its learner is larger than every built-in above);
# importing it here registers it wherever a policy name can be parsed.
from .adaptive import AdaptivePolicy  # noqa: E402

__all__ += ["AdaptivePolicy"]
