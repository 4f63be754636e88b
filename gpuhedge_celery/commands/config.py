"""``gpuhedge-celery config check [FILE]``: validate a YAML config before it is deployed;
``config show [FILE]``: the resolved config as JSON, secrets redacted."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import ConfigError, GpuHedgeError, PluginNotImported

if TYPE_CHECKING:
    from ..config import GpuHedgeConfig


@click.group(name="config")
def command() -> None:
    """Check or show the YAML configuration (docs/configuration.md)."""


@command.command(name="check")
@click.argument("file", required=False)
@click.option("--strict", is_flag=True, help="Exit 1 when there is any warning.")
def check(file: str | None, strict: bool) -> None:
    """Load and validate FILE as a worker would, and print one line: ``ok: ...`` (exit code 0)
    or the error naming the file and key (exit code 2).

    A budget cap that refuses an attempt the policy can launch (a hedge whose worst case does
    not fit beside the primary's under max_usd_per_request, say) is a warning: the line says
    ``ok with N warning(s)`` and one ``warning:`` line per attempt follows, with the
    arithmetic. The exit code stays 0, since the config does run, unless --strict (then 1).

    Without FILE it checks the config this installation would use: --config / GPUHEDGE_CONFIG,
    else ./config/gpuhedge.yaml, else the packaged default. ${VAR} references are resolved
    when a worker builds a provider, so unset variables are not reported here. Modules the
    file names (plugins:, a module:Name policy or adapter) are not imported: checking a file
    runs none of its code; a note lists them, and workers check them at start.
    """
    from ..cli import EXIT_FAILED, root_config
    from ..config import cap_warnings
    from ..plugins import without_plugin_code

    if file is not None and not Path(file).is_file():
        raise ConfigError("config file not found", file=file)
    with without_plugin_code():
        cfg = root_config(file)
        unchecked = unimported_plugins(cfg)
        try:
            warnings = [w.text() for w in cap_warnings(cfg)]
        except PluginNotImported:
            warnings = []  # the policy is a plugin's: the workers check its attempts
    providers = ", ".join(
        f"{p.name} ({p.role}{'' if p.deployed else ', not deployed'})"
        for p in cfg.providers.values()
    )
    status = "ok"
    if warnings:
        status = f"ok with {len(warnings)} warning{'s' if len(warnings) > 1 else ''}"
    click.echo(
        f"{status}: {cfg.source}: providers {providers or 'none'}; policy {cfg.policy.name}; "
        f"validator {cfg.validator.name}"
    )
    for line in warnings:
        click.echo(f"warning: {line}")
    if unchecked:
        click.echo(
            f"note: not imported here (config check runs no code the file names): "
            f"{', '.join(unchecked)}; workers import and check them at start"
        )
    if warnings and strict:
        raise click.exceptions.Exit(EXIT_FAILED)


def unimported_plugins(cfg: GpuHedgeConfig) -> list[str]:
    """The modules ``cfg`` names (plugins:, a ``module:Name`` policy or adapter) that were
    not imported in this process."""
    from ..plugins import loaded

    named = set(cfg.plugins)
    if ":" in cfg.policy.name:
        named.add(cfg.policy.name.partition(":")[0])
    named |= {p.adapter.partition(":")[0] for p in cfg.providers.values() if ":" in p.adapter}
    return sorted(m for m in named if not loaded(m) and not m.startswith("gpuhedge_celery."))


def _redacted(value: Any, path: str, secrets: list[str]) -> Any:
    """An adapter block with header values, secret-named keys and known secrets replaced."""
    from ._accounts import REDACTED, SECRET_KEY

    if isinstance(value, Mapping):
        return {str(k): _redacted(v, f"{path}.{k}", secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v, f"{path}.{i}", secrets) for i, v in enumerate(value)]
    if isinstance(value, str):
        name = path.rsplit(".", 1)[-1]
        if ".headers." in path or SECRET_KEY.search(name):
            return REDACTED
        for secret in secrets:
            value = value.replace(secret, REDACTED)
    return value


def resolved(cfg: GpuHedgeConfig) -> dict[str, Any]:
    """The config as a worker uses it, defaults filled in, as JSON data with secrets redacted.

    ``${VAR}`` references are shown as written, never expanded from the environment."""
    from ..config_budget import spends_money
    from ._accounts import secrets_of

    secrets = secrets_of(cfg)
    providers = {}
    for name, p in cfg.providers.items():
        providers[name] = {
            "adapter": p.adapter,
            "role": p.role,
            "gpu": p.gpu,
            "deployed": p.deployed,
            "billed_rate_per_s": p.billed_rate_per_s,
            "idle_billed_seconds": p.idle_billed_seconds,
            "cap_s": cfg.cap_s(name),
            "spends_money": spends_money(p),
            p.adapter if ":" not in p.adapter else "options": _redacted(
                dict(p.options), f"providers.{name}", secrets
            ),
        }
    try:
        policy = cfg.make_policy().name
    except GpuHedgeError as e:
        policy = f"unresolved: {e}"
    return {
        "source": cfg.source,
        "time_scale": cfg.time_scale,
        "providers": providers,
        "policy": {"name": cfg.policy.name, "params": dict(cfg.policy.params), "resolved": policy},
        "slo": {"deadlines_s": list(cfg.slo_deadlines_s)},
        "timeouts": {"attempt_cap_s": cfg.attempt_cap_s},
        "budget": cfg.budget.to_dict(),
        "validator": {"name": cfg.validator.name, **dict(cfg.validator.options)},
    }


@command.command(name="show")
@click.argument("file", required=False)
def show(file: str | None) -> None:
    """Print the resolved config as JSON (defaults filled in, secrets redacted)."""
    from ..cli import root_config
    from ..plugins import without_plugin_code
    from ._accounts import redactor

    if file is not None and not Path(file).is_file():
        raise ConfigError("config file not found", file=file)
    with without_plugin_code():  # showing a file runs none of the code it names
        cfg = root_config(file)
        click.echo(redactor(cfg)(json.dumps(resolved(cfg), indent=2, default=str)))
