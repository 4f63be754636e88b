"""What a race runs with: its policy, validator, caps and rates, resolved from config and call.

``hedged_infer(request, policy=None, providers=None, validator=None, *, budget_key=None,
arm=None)`` accepts:

* ``policy``: ``None`` (the config's policy), a built-in name (``single``, ``fixed``,
  ``state_aware``, ``cascade``; providers from ``providers=`` or the config's roles), or a full
  spec (``hedge:P->H@10s``, ``cutover:P->H@q2.5s+s8.5s``, ``cascade:P->H->F@...``, or any
  registered custom kind). The config's own timings are provider time, scaled by its
  ``time_scale``; a full spec's timings are taken as written (real time), as
  :meth:`~gpuhedge_celery.config.GpuHedgeConfig.make_policy` does;
* ``providers``: names overriding the roles (primary first) for a built-in name;
* ``validator``: a registered validator name, or ``{"name": ..., **options}``; under a config
  whose validator is ``hmac`` it is an added check after the signature's, never a replacement
  (whoever sends a message must not switch signature checks off);
* ``budget_key``: whose budget the race spends (``budget.keys`` in the config), or None: with
  ``budget.keys`` set, a key not listed is refused (or, under ``unknown_keys: default``, charged
  to ``budget.default_key``) and None is charged to ``budget.default_key``;
* ``arm``: the experiment arm the race runs in (``gpuhedge-celery experiment``), or None; its
  record carries it (``docs/records.md``).

Every problem is a one-line :class:`~gpuhedge_celery.errors.ConfigError` naming the argument.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import ROLE_ARGS, GpuHedgeConfig
from ..core.experiment import ARM_RE
from ..core.policies import Policy, policy_from_dict, registered_policies
from ..core.rates import ProviderRate
from ..core.validators import available_validators, options_problem
from ..core.validators_signed import SIGNATURE_PROVES_END, SIGNED, adding_check
from ..errors import ConfigError
from ..store import codec


@dataclass(frozen=True)
class RaceSpec:
    """A resolved race: policy (real-time timings), validator, per-provider caps and rates."""

    policy: Policy
    validator: str = "nonempty"
    validator_options: Mapping[str, Any] = field(default_factory=dict)
    caps_s: Mapping[str, float] = field(default_factory=dict)  # real seconds per attempt
    rates: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # per real second
    time_scale: float = 1.0
    deadline_s: float | None = None  # real seconds from start; None: no deadline
    budget_key: str | None = None  # whose budget the race spends (budget.keys)
    arm: str | None = None  # the experiment arm the race runs in (its record carries it)
    # the config's own validator is hmac (its key, not a message's): a signature shows an end
    signature_proves_end: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form stored with the race (the policy travels in the race's own state)."""
        data = {
            "deadline_s": self.deadline_s,
            "validator": self.validator,
            "validator_options": dict(self.validator_options),
            "caps_s": dict(self.caps_s),
            "rates": {k: dict(v) for k, v in self.rates.items()},
            "time_scale": self.time_scale,
            "budget_key": self.budget_key,
        }
        if self.arm is not None:  # only an experiment's races carry one
            data["arm"] = self.arm
        if self.signature_proves_end:  # left out otherwise: an earlier release never sets it
            data[SIGNATURE_PROVES_END] = True
        return data

    def provider_rates(self) -> dict[str, ProviderRate]:
        """Rates in the form :func:`~gpuhedge_celery.core.outcome.race_outcome` prices with."""
        return {k: ProviderRate(v["rate_per_s"], v["idle_s"]) for k, v in self.rates.items()}


def check_request(request: Any, max_bytes: int | None = None) -> dict[str, Any]:
    """The request if it is a JSON object of at most ``max_bytes`` bytes as compact JSON (the
    form the race store keeps); a one-line ConfigError otherwise."""
    if not isinstance(request, dict):
        raise ConfigError(
            f"expected a JSON object (dict), got {type(request).__name__}", key="request"
        )
    try:
        # the encoder the race store writes with: what passes here is stored without a surprise
        size = codec.size(request)
    except (TypeError, ValueError, RecursionError) as e:  # bytes, sets, non-str keys, too deep
        raise ConfigError(f"not JSON-serialisable: {e}", key="request") from None
    if max_bytes is not None and size > max_bytes:
        raise ConfigError(
            f"{size:,} bytes as JSON, over the {max_bytes:,}-byte limit "
            "(GPUHEDGE_REQUEST_MAX_BYTES): send a reference to large data (a URL, an object "
            "key) instead of the data",
            key="request",
        )
    return request


def request_summary(request: Any) -> str:
    """What task events and logs show of a caller's request: its size as compact JSON, never
    its content (not even a digest: a short request could be guessed back from one)."""
    try:
        size = codec.size(request)
    except (TypeError, ValueError, RecursionError):
        return f"<request: {type(request).__name__}, not JSON>"
    return f"<request: {size:,} bytes>"


def _check_providers(cfg: GpuHedgeConfig, names: Any) -> list[str]:
    if not isinstance(names, (list, tuple)) or not names or len(names) > 3:
        raise ConfigError(
            f"expected a list of 1-3 provider names, primary first, got {names!r}",
            key="providers",
        )
    for name in names:
        if not isinstance(name, str):
            raise ConfigError(f"expected provider names, got {name!r}", key="providers")
    if len(set(names)) != len(names):
        raise ConfigError(f"a provider appears twice in {list(names)}", key="providers")
    return [_deployed(cfg, name, "providers") for name in names]


def _deployed(cfg: GpuHedgeConfig, name: str, key: str) -> str:
    found = cfg.providers.get(name)
    if found is None:
        known = ", ".join(cfg.providers) or "none"
        raise ConfigError(f"no provider {name!r} (known: {known})", key=key)
    if not found.deployed:
        raise ConfigError(f"provider {name!r} has deployed: false", key=key)
    return name


def resolve_policy(cfg: GpuHedgeConfig, policy: Any = None, providers: Any = None) -> Policy:
    """The race's policy (see the module docstring for what is accepted).

    Built by :meth:`GpuHedgeConfig.make_policy`: config milliseconds are scaled by
    ``time_scale``, full names are taken as written (real time).
    """
    chosen = None if providers is None else _check_providers(cfg, providers)
    if policy is not None and not isinstance(policy, str):
        raise ConfigError(
            f"expected a policy name or a spec like 'hedge:P->H@10s', got {policy!r}",
            key="policy",
        )
    full = isinstance(policy, str) and ":" in policy and policy.split(":", 1)[0] in _KINDS()
    if full and chosen is not None:
        raise ConfigError(
            "name the providers inside the policy spec or with providers=, not both",
            key="providers",
        )
    made = cfg.make_policy(policy.strip() if isinstance(policy, str) else None)
    if chosen is not None:
        params = made.params()
        roles = [r for r in ROLE_ARGS if r in params]
        if len(chosen) != len(roles):
            raise ConfigError(
                f"policy {made.kind!r} races {len(roles)} provider(s), got {len(chosen)}: {chosen}",
                key="providers",
            )
        params.update(zip(roles, chosen, strict=True))
        made = type(made)(**params)
    for name in made.providers():
        _deployed(cfg, name, "policy")
    return made


def _KINDS() -> dict[str, Any]:  # noqa: N802 - read at call time: plugins may add kinds
    return registered_policies()


def resolve_validator(cfg: GpuHedgeConfig, validator: Any = None) -> tuple[str, dict[str, Any]]:
    """``(name, options)`` of the validator: the call's, else the config's; under the config's
    ``hmac`` the call's is checked after the signature instead (it may add, never replace)."""
    configured = cfg.validator.name, dict(cfg.validator.options)
    if validator is None:
        return configured
    if isinstance(validator, str):
        name, options = validator, {}
    elif isinstance(validator, Mapping) and isinstance(validator.get("name"), str):
        name = validator["name"]
        options = {k: v for k, v in validator.items() if k != "name"}
    else:
        raise ConfigError(
            f"expected a validator name or {{'name': ..., **options}}, got {validator!r}",
            key="validator",
        )
    if name not in available_validators():
        known = ", ".join(available_validators())
        raise ConfigError(f"unknown validator {name!r} (known: {known})", key="validator")
    problem = options_problem(name, options)
    if problem is not None:
        raise ConfigError(problem, key="validator")
    if configured[0] != SIGNED or (name, options) == configured:
        return name, options
    return SIGNED, adding_check(configured[1], {"name": name, **options})


SPEC_OPTIONS = ("budget_key", "arm")  # hedged_infer's seldom-used keywords, None by default


def check_options(func: str, options: Mapping[str, Any]) -> None:
    """The TypeError Python raises for a keyword that ``func``'s signature does not name."""
    for name in options:
        if name not in SPEC_OPTIONS:
            raise TypeError(f"{func}() got an unexpected keyword argument {name!r}")


def build_spec(
    cfg: GpuHedgeConfig,
    policy: Any = None,
    providers: Any = None,
    validator: Any = None,
    **options: Any,
) -> RaceSpec:
    """Resolve every argument of ``hedged_infer`` against ``cfg`` into a :class:`RaceSpec`.

    ``options``: ``budget_key`` and ``arm`` (see the module docstring), by keyword only.
    """
    check_options("build_spec", options)
    budget_key, arm = options.get("budget_key"), options.get("arm")
    problem = cfg.budget.key_problem(budget_key)
    if problem is not None:
        raise ConfigError(problem, key="budget_key")
    budget_key = cfg.budget.charged_key(budget_key)  # key caps apply whatever the caller says
    if arm is not None and not (isinstance(arm, str) and ARM_RE.match(arm)):
        raise ConfigError(
            f"expected an arm name of 1-100 letters, digits, '_', '-', '.', ':', got {arm!r}",
            key="arm",
        )
    resolved = resolve_policy(cfg, policy, providers)
    v_name, v_options = resolve_validator(cfg, validator)
    scale = cfg.time_scale
    caps, rates = {}, {}
    for name in resolved.providers():
        p = cfg.provider(name)
        caps[name] = cfg.cap_s(name) * scale
        # race times are real seconds; bill them as the provider time they stand for
        rates[name] = {
            "rate_per_s": p.billed_rate_per_s / scale,
            "idle_s": p.idle_billed_seconds * scale,
        }
    deadline = cfg.race_deadline_for(resolved.providers()) * scale
    # the configured key, resolve_validator keeps it: a message adds checks, never a key
    proves = cfg.validator.name == SIGNED and v_name == SIGNED
    return RaceSpec(
        resolved, v_name, v_options, caps, rates, scale, deadline, budget_key, arm, proves
    )


def longest_race_s(
    cfg: GpuHedgeConfig, policy: Any = None, providers: Any = None, *, slack_s: float = 5.0
) -> float:
    """The longest a race under ``cfg`` can take, in real seconds: a timeout for ``.get()``.

    Every attempt is launched at one of the policy's timers or when an earlier attempt ended,
    and ends within its provider's slowest job (a sim provider knows it: slowest queue plus
    run) or its cap, whichever is shorter. So the race ends within the policy's latest timer
    plus the longest attempt of every provider it may launch, plus ``slack_s`` for submits,
    status polls and cancel confirmations. An upper bound, not a typical time.
    """
    spec = build_spec(cfg, policy, providers)
    timers = [
        v
        for k, v in spec.policy.params().items()
        if k.endswith("_ms") and isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    total = max(timers, default=0) / 1000.0  # the policy's params are in real milliseconds
    for name in spec.policy.providers():
        job = getattr(cfg.provider(name).spec, "longest_job_s", None)
        longest = job() if callable(job) else math.inf
        total += min(spec.caps_s[name], longest)
    return total + slack_s


def spec_from_state(state: dict[str, Any]) -> RaceSpec:
    """The :class:`RaceSpec` a race was created with, rebuilt from its stored state."""
    data = state["spec"]
    return RaceSpec(
        policy=policy_from_dict(state["race"]["policy"]),
        validator=data["validator"],
        validator_options=data.get("validator_options") or {},
        caps_s=data.get("caps_s") or {},
        rates=data.get("rates") or {},
        time_scale=float(data.get("time_scale", 1.0)),
        deadline_s=data.get("deadline_s"),
        budget_key=data.get("budget_key"),
        arm=data.get("arm"),
        signature_proves_end=bool(data.get(SIGNATURE_PROVES_END)),
    )
