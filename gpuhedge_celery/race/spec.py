"""What a race runs with: its policy, validator, caps and rates, resolved from config and call.

``hedged_infer(request, policy=None, providers=None, validator=None)`` accepts:

* ``policy``: ``None`` (the config's policy), a built-in name (``single``, ``fixed``,
  ``state_aware``, ``cascade``; providers from ``providers=`` or the config's roles), or a full
  spec (``hedge:P->H@10s``, ``cutover:P->H@q2.5s+s8.5s``, ``cascade:P->H->F@...``, or any
  registered custom kind). The config's own timings are provider time, scaled by its
  ``time_scale``; a full spec's timings are taken as written (real time), as
  :meth:`~gpuhedge_celery.config.GpuHedgeConfig.make_policy` does;
* ``providers``: names overriding the roles (primary first) for a built-in name;
* ``validator``: a registered validator name, or ``{"name": ..., **options}``.

Every problem is a one-line :class:`~gpuhedge_celery.errors.ConfigError` naming the argument.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import ROLE_ARGS, GpuHedgeConfig
from ..core.outcome import ProviderRate
from ..core.policies import Policy, policy_from_dict, registered_policies
from ..core.validators import available_validators, get_validator
from ..errors import ConfigError


@dataclass(frozen=True)
class RaceSpec:
    """A resolved race: policy (real-time timings), validator, per-provider caps and rates."""

    policy: Policy
    validator: str = "nonempty"
    validator_options: Mapping[str, Any] = field(default_factory=dict)
    caps_s: Mapping[str, float] = field(default_factory=dict)  # real seconds per attempt
    rates: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # per real second
    time_scale: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form stored with the race (the policy travels in the race's own state)."""
        return {
            "validator": self.validator,
            "validator_options": dict(self.validator_options),
            "caps_s": dict(self.caps_s),
            "rates": {k: dict(v) for k, v in self.rates.items()},
            "time_scale": self.time_scale,
        }

    def provider_rates(self) -> dict[str, ProviderRate]:
        """Rates in the form :func:`~gpuhedge_celery.core.outcome.race_outcome` prices with."""
        return {k: ProviderRate(v["rate_per_s"], v["idle_s"]) for k, v in self.rates.items()}


def check_request(request: Any) -> dict[str, Any]:
    """The request if it is a JSON object; a one-line ConfigError otherwise."""
    if not isinstance(request, dict):
        raise ConfigError(
            f"expected a JSON object (dict), got {type(request).__name__}", key="request"
        )
    try:
        json.dumps(request)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"not JSON-serialisable: {e}", key="request") from None
    return request


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
    """``(name, options)`` of the validator: the call's, else the config's."""
    if validator is None:
        return cfg.validator.name, dict(cfg.validator.options)
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
    try:
        inspect.signature(get_validator(name)).bind(None, **options)
    except TypeError as e:
        raise ConfigError(f"bad options for validator {name!r}: {e}", key="validator") from None
    return name, options


def build_spec(
    cfg: GpuHedgeConfig, policy: Any = None, providers: Any = None, validator: Any = None
) -> RaceSpec:
    """Resolve every argument of ``hedged_infer`` against ``cfg`` into a :class:`RaceSpec`."""
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
    return RaceSpec(resolved, v_name, v_options, caps, rates, scale)


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
    )
