"""The YAML configuration: providers, policy, SLO deadlines, attempt caps, budget, validator.

Lookup order (first found wins): an explicit path (``--config`` / ``GPUHEDGE_CONFIG``), then
``./config/gpuhedge.yaml``, then the packaged default ``gpuhedge_celery/data/default.yaml``.

Every error is one line naming the file, the dotted key and what was expected, e.g.
``my.yaml: providers.runpod.billed_rate_per_s: expected a number >= 0, got 'cheap'``. Unknown
keys (and duplicated keys) are errors, never ignored. ``${VAR}`` references inside adapter
blocks are resolved when a provider is built, not at load, so a config naming an API key that
this process does not need still loads. See docs/configuration.md for every key.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from .config_budget import parse_budget
from .core.budget import BudgetCaps, CapConflict, PlannedAttempt, cap_conflicts
from .errors import ConfigError, PluginNotImported
from .plugins import dry as plugins_dry
from .plugins import load as load_plugins
from .plugins import loaded as plugin_loaded
from .providers.options import Block
from .providers.provider_config import ROLES, ProviderConfig
from .providers.registry import build_provider, parse_provider, parse_provider_entry

if TYPE_CHECKING:
    from .core.policies import Policy

# ProviderConfig and parse_provider live with the provider registry (no import cycle between
# the two); they are part of this module's API as well.
__all__ = [
    "DEFAULT_PATH",
    "ROLES",
    "GpuHedgeConfig",
    "PolicyConfig",
    "ProviderConfig",
    "ValidatorConfig",
    "find_config",
    "load_config",
    "packaged_path",
    "parse_config",
    "parse_config_text",
    "parse_provider",
]

DEFAULT_PATH = Path("config") / "gpuhedge.yaml"
PACKAGED_DIR = Path(__file__).parent / "data"

ROLE_ARGS = ("primary", "hedge", "fallback")  # policy arguments filled from provider roles
# Provider seconds a race may take beyond its providers' caps added up, before it gives up
# (timeouts.race_deadline_s overrides): launch, cancel and polling windows.
RACE_SLACK_S = 60.0


@dataclass(frozen=True)
class PolicyConfig:
    """The default race policy: a registered kind or alias (``fixed``, ``state_aware``,
    ``cascade``, or ``package.module:kind`` for one registered on import) and its parameters,
    in provider-time milliseconds; ``primary``/``hedge``/``fallback`` default to the roles."""

    name: str = "fixed"
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ValidatorConfig:
    """The default validator: a registered name and its options."""

    name: str = "nonempty"
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuHedgeConfig:
    """A loaded configuration. Durations are in provider time; multiply by ``time_scale`` for
    real time (1.0 everywhere except compressed simulations such as the demo)."""

    source: str
    providers: Mapping[str, ProviderConfig]
    policy: PolicyConfig = PolicyConfig()
    slo_deadlines_s: tuple[float, ...] = (60.0,)
    attempt_cap_s: float = 180.0
    race_deadline_s: float | None = None  # None: the race's caps added up, plus RACE_SLACK_S
    budget: BudgetCaps = BudgetCaps()
    validator: ValidatorConfig = ValidatorConfig()
    time_scale: float = 1.0
    plugins: tuple[str, ...] = ()  # modules the file lists under plugins: (gpuhedge_celery.plugins)

    @property
    def budget_usd_per_request(self) -> float | None:
        """``budget.max_usd_per_request`` (see :attr:`budget` for every cap)."""
        return self.budget.max_usd_per_request

    def provider(self, name: str) -> ProviderConfig:
        """The provider called ``name``; a one-line ConfigError listing the known ones if none."""
        try:
            return self.providers[name]
        except KeyError:
            known = ", ".join(self.providers) or "none"
            raise ConfigError(f"no provider {name!r} (known: {known})", file=self.source) from None

    def by_role(self, role: str, *, deployed_only: bool = True) -> list[ProviderConfig]:
        """Providers with ``role`` in file order (only deployed ones unless told otherwise)."""
        return [
            p
            for p in self.providers.values()
            if p.role == role and (p.deployed or not deployed_only)
        ]

    def cap_s(self, name: str) -> float:
        """The per-attempt cap for provider ``name`` (its ``timeout_s``, else ``attempt_cap_s``)."""
        own = self.provider(name).timeout_s
        return own if own is not None else self.attempt_cap_s

    def race_deadline_for(self, names: Sequence[str]) -> float:
        """Seconds (provider time) after which a race of ``names`` that has no winner gives
        up: ``timeouts.race_deadline_s``, else every provider's cap added up plus
        :data:`RACE_SLACK_S` (room for launch and cancel windows)."""
        if self.race_deadline_s is not None:
            return self.race_deadline_s
        return sum(self.cap_s(name) for name in dict.fromkeys(names)) + RACE_SLACK_S

    def scaled_policy_params(self) -> dict[str, Any]:  # kept for callers without make_policy
        """Policy parameters in real time: every ``*_ms`` value multiplied by ``time_scale``."""
        return {
            k: (v * self.time_scale if k.endswith("_ms") and isinstance(v, (int, float)) else v)
            for k, v in self.policy.params.items()
        }

    def make_policy(self, spec: str | None = None) -> Policy:
        """The race engine's policy for ``spec``.

        None: the configured policy. A kind (``fixed``, ``cascade``...): that policy with the
        providers of each role, and the configured parameters when it is the configured kind
        (else the policy's defaults). A full name (``hedge:a->b@10s``): parsed as written.
        Milliseconds from the config are scaled by ``time_scale``; full names are not.
        """
        from .core.policies import parse_policy, registered_policies

        spec = spec or self.policy.name
        if spec.split(":", 1)[0] in registered_policies() and ":" in spec:
            return parse_policy(spec)
        cls = _policy_class(spec, None, unchecked=plugins_dry() and bool(self.plugins))
        if cls is None:
            raise PluginNotImported(
                f"policy {spec!r} is a plugin's, not imported here", key="policy"
            )
        params = self.policy.params if spec == self.policy.name else {}
        args: dict[str, Any] = {}
        for arg, parameter in _policy_args(cls).items():
            if arg in params:
                value = params[arg]
            elif arg in ROLE_ARGS:
                found = self.by_role(arg)
                if not found:
                    raise ConfigError(
                        f"policy {spec!r} needs a deployed provider with role: {arg}",
                        file=self.source,
                        key="providers",
                    )
                value = found[0].name
            elif parameter.default is not inspect.Parameter.empty:
                value = parameter.default
            else:
                raise ConfigError(f"policy {spec!r} needs {arg}", file=self.source, key="policy")
            if arg.endswith("_ms") and isinstance(value, (int, float)):
                value = round(value * self.time_scale)
            args[arg] = value
        return cls(**args)

    def build(self, name: str, **kwargs: Any):
        """Build provider ``name`` (kwargs to the adapter: ``clock``, ``sleep``, ``env``...)."""
        found = self.provider(name)
        if found.timeout_s is None:  # the adapter sees the cap the races use (RunPod's own stop)
            found = replace(found, timeout_s=self.attempt_cap_s)
        return build_provider(name, found, **kwargs)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be overridden
            continue
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def packaged_path(name: str = "default.yaml") -> Path:
    """Path of a config shipped inside the package (``default.yaml``, ``demo.yaml``)."""
    path = PACKAGED_DIR / name
    if not path.is_file():
        known = ", ".join(sorted(p.name for p in PACKAGED_DIR.glob("*.yaml")))
        raise ConfigError(f"no packaged config {name!r} (packaged: {known})")
    return path


def find_config(explicit: str | Path | None = None, *, cwd: str | Path | None = None) -> Path:
    """The config file to use: ``explicit``, else ./config/gpuhedge.yaml, else the packaged one."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise ConfigError(
                "config file not found (from --config or GPUHEDGE_CONFIG)", file=str(path)
            )
        return path
    local = Path(cwd or Path.cwd()) / DEFAULT_PATH
    if local.is_file():
        return local
    return packaged_path("default.yaml")


def load_config(path: str | Path | None = None, *, cwd: str | Path | None = None) -> GpuHedgeConfig:
    """Find (see :func:`find_config`), read and validate a config file."""
    found = find_config(path, cwd=cwd)
    try:
        text = found.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror or e}", file=str(found)) from e
    return parse_config_text(text, source=str(found))


def parse_config_text(text: str, source: str = "<string>") -> GpuHedgeConfig:
    """Parse YAML text into a validated :class:`GpuHedgeConfig` (``source`` names it in errors)."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"invalid YAML{where}: {problem}", file=source) from None
    return parse_config(data, source=source)


def parse_config(data: Any, source: str = "<dict>") -> GpuHedgeConfig:
    """Validate an already-parsed mapping (the YAML document) into a :class:`GpuHedgeConfig`."""
    root = Block(data, "", source)
    time_scale = root.number("time_scale", 1.0, positive=True)
    unchecked = _load_plugins(root)
    providers_block = root.mapping("providers")
    providers: dict[str, ProviderConfig] = {}
    for name in providers_block.data:
        providers_block.raw(name)
        providers[str(name)] = parse_provider_entry(providers_block, str(name), time_scale)
    if not providers:  # an empty file (a config map mounted empty) would fail every race
        raise providers_block.error(
            None, "empty: expected at least one provider with role: primary"
        )
    if not any(p.role == "primary" for p in providers.values()):
        raise providers_block.error(None, "expected at least one provider with role: primary")

    policy_block = root.mapping("policy")
    policy = _parse_policy(policy_block, providers, unchecked)

    slo = root.mapping("slo")
    deadlines = slo.raw("deadlines_s", [60.0])
    if (
        not isinstance(deadlines, list)
        or not deadlines
        or not all(
            isinstance(d, (int, float)) and not isinstance(d, bool) and d > 0 for d in deadlines
        )
    ):
        raise slo.error(
            "deadlines_s", f"expected a non-empty list of seconds > 0, got {deadlines!r}"
        )
    slo.finish()

    timeouts = root.mapping("timeouts")
    attempt_cap_s = timeouts.number("attempt_cap_s", 180.0, positive=True)
    race_deadline_s = timeouts.number("race_deadline_s", None, positive=True)
    timeouts.finish()

    budget = parse_budget(root, providers)

    validator = _parse_validator(root, unchecked)
    root.finish()
    return GpuHedgeConfig(
        source=source,
        providers=providers,
        policy=policy,
        plugins=tuple(root.raw("plugins", None) or ()),
        slo_deadlines_s=tuple(float(d) for d in deadlines),
        attempt_cap_s=attempt_cap_s,
        race_deadline_s=race_deadline_s,
        budget=budget,
        validator=validator,
        time_scale=time_scale,
    )


def _load_plugins(root: Block) -> bool:
    """Import the modules the file names (``plugins:``, and the module of a ``module:Name``
    policy or adapter) before anything resolves: the file is trusted, a message is not.
    True under ``config check`` when the file lists plugins: then a policy kind or validator
    none of the package's own registers may be theirs, and is not checked."""
    listed = root.raw("plugins", None)
    if listed is not None and not (
        isinstance(listed, list) and all(isinstance(m, str) for m in listed)
    ):
        raise root.error("plugins", f"expected a list of module paths, got {listed!r}")
    load_plugins(listed or [], key="plugins", file=root.file)
    policy = root.data.get("policy") if isinstance(root.data, Mapping) else None
    name = policy.get("name") if isinstance(policy, Mapping) else None
    if isinstance(name, str) and ":" in name:
        load_plugins(
            [name.partition(":")[0]], key="policy.name", file=root.file, what="policy module"
        )
    return plugins_dry() and bool(listed)


def _policy_class(
    name: str, block: Block | None, *, unchecked: bool = False
) -> type[Policy] | None:
    """The registered policy class for ``name`` (``kind`` or ``package.module:kind``).

    Nothing is imported here: a ``module:kind`` resolves only when a trusted source had the
    module imported (:mod:`.plugins`), so a policy name in a task message runs no code. None
    under ``config check`` for a plugin's kind, which is listed there but not imported."""
    from .core.policies import registered_policies

    kind = name
    if ":" in name:
        module, _, kind = name.partition(":")
        if not plugin_loaded(module):
            if plugins_dry():
                return None
            message = (
                f"policy module {module!r} is not a plugin of this deployment (list it "
                "under plugins: in the config or in GPUHEDGE_PLUGINS)"
            )
            raise block.error("name", message) if block else ConfigError(message, key="policy")
    cls = registered_policies().get(kind)
    if cls is None and unchecked:
        return None
    if cls is None:
        known = ", ".join(sorted(registered_policies()))
        message = f"expected one of {known}, or 'package.module:kind', got {name!r}"
        raise block.error("name", message) if block else ConfigError(message, key="policy")
    return cls


def _policy_args(cls: type[Policy]) -> dict[str, inspect.Parameter]:
    params = inspect.signature(cls.__init__).parameters
    return {k: p for k, p in params.items() if k != "self" and p.kind is p.POSITIONAL_OR_KEYWORD}


def _parse_policy(
    block: Block, providers: Mapping[str, ProviderConfig], unchecked: bool = False
) -> PolicyConfig:
    has_hedge = any(p.role == "hedge" and p.deployed for p in providers.values())
    name = block.string("name", "fixed" if has_hedge or not providers else "single")
    cls = _policy_class(name, block, unchecked=unchecked)
    if cls is None:  # a plugin's kind under config check: its parameters are not checked
        params: dict[str, Any] = dict(block.mapping("params").data)
        block.finish()
        return PolicyConfig(name=name, params=params)
    allowed = _policy_args(cls)
    params_block = block.mapping("params")
    params = {}
    for key in params_block.data:
        if key not in allowed:
            continue  # reported by finish() below with the list of known parameters
        value = params_block.raw(key)
        if key in ROLE_ARGS:
            if not isinstance(value, str) or value not in providers:
                known = ", ".join(providers) or "none"
                raise params_block.error(key, f"expected a provider name ({known}), got {value!r}")
        elif key.endswith("_ms") and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
        ):
            raise params_block.error(key, f"expected milliseconds >= 0, got {value!r}")
        params[key] = value
    params_block.finish(extra_known=allowed)
    for role in ROLE_ARGS:
        if providers and role in allowed and role not in params:
            if not any(p.role == role and p.deployed for p in providers.values()):
                raise block.error(
                    "name", f"policy {name!r} needs a deployed provider with role: {role}"
                )
    block.finish()
    return PolicyConfig(name=name, params=params)


def _parse_validator(root: Block, unchecked: bool = False) -> ValidatorConfig:
    from .core.validators import available_validators, options_problem

    value = root.raw("validator", "nonempty")
    if isinstance(value, str):
        name, options = value, {}
    elif isinstance(value, Mapping):
        block = root.mapping("validator")
        name = block.string("name")
        options = {k: v for k, v in value.items() if k != "name"}
    else:
        raise root.error("validator", f"expected a name or {{name: ..., options}}, got {value!r}")
    if name not in available_validators() and unchecked:  # a plugin's, under config check
        return ValidatorConfig(name=name, options=options)
    if name not in available_validators():
        known = ", ".join(available_validators())
        raise root.error(
            "validator",
            f"unknown validator {name!r} (known: {known}; register yours with @validator first)",
        )
    problem = options_problem(name, options)
    if problem is not None:
        raise root.error("validator", problem)
    return ValidatorConfig(name=name, options=options)


def planned_attempts(cfg: GpuHedgeConfig, policy: Policy | None = None) -> list[PlannedAttempt]:
    """The attempts ``policy`` (the configured one by default) can launch, in launch order,
    each with its role, the config's cap for its provider, its rate and idle window."""
    policy = policy or cfg.make_policy()
    names = list(policy.providers())
    params = policy.params()
    named = [(role, params[role]) for role in ROLES if isinstance(params.get(role), str)]
    if [name for _, name in named] != names:  # a custom policy: the providers' own roles
        named = [(cfg.provider(name).role, name) for name in names]
    found = []
    for role, name in named:
        p = cfg.provider(name)
        found.append(
            PlannedAttempt(name, role, cfg.cap_s(name), p.billed_rate_per_s, p.idle_billed_seconds)
        )
    return found


def cap_warnings(cfg: GpuHedgeConfig, policy: Policy | None = None) -> list[CapConflict]:
    """Every budget cap that refuses an attempt the configured policy can launch (see
    :func:`~gpuhedge_celery.core.budget.cap_conflicts`); empty when budgets are off."""
    if not cfg.budget.enabled:
        return []
    return cap_conflicts(cfg.budget, planned_attempts(cfg, policy))
