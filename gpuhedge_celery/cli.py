"""The ``gpuhedge-celery`` command line.

Sub-commands live one per module in :mod:`gpuhedge_celery.commands` (each module exposes a click
command named like the module) and are discovered lazily, so ``--help`` stays fast and a command's
heavy imports (Celery, matplotlib) load only when it runs.

Exit codes: 0 ok, 1 a check failed, 2 usage or configuration error, 3 Redis unreachable.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from . import settings as process_settings
from .errors import ConfigError, GpuHedgeError, StoreUnavailable
from .settings import Settings

if TYPE_CHECKING:
    from .config import GpuHedgeConfig

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_REDIS = 3


@dataclass
class CliContext:
    """What every sub-command receives through ``click.pass_obj``."""

    settings: Settings


def root_settings() -> Settings:
    """The settings of the running ``gpuhedge-celery`` invocation (from any sub-command)."""
    return click.get_current_context().find_root().obj.settings


def root_config(path: str | None = None) -> GpuHedgeConfig:
    """The YAML config a sub-command uses: ``path``, else the global ``--config`` /
    ``GPUHEDGE_CONFIG``, else the usual lookup; a ConfigError (exit code 2) when it is missing
    or invalid. Every command that uses the config reads it through here."""
    from .config import load_config

    return load_config(path or root_settings().config_path)


def cli_redis_client():
    """A redis-py client for CLI commands: one quick connection attempt, so a dead Redis fails
    fast with a one-line error (exit code 3) instead of retrying."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from .store.connection import redis_from_url

    return redis_from_url(
        root_settings().redis_url,
        decode_responses=True,
        socket_connect_timeout=3,
        socket_timeout=10,
        retry=Retry(NoBackoff(), 1),
    )


def discover(package: str) -> dict[str, str]:
    """Map command names to ``module`` paths for every non-private module in ``package``."""
    pkg = importlib.import_module(package)
    names = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            names[info.name.replace("_", "-")] = f"{package}.{info.name}"
    return names


class LazyGroup(click.Group):
    """A click group whose sub-commands are modules of a package, imported on first use."""

    def __init__(self, *args, package: str, **kwargs):
        super().__init__(*args, **kwargs)
        self._package = package

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(discover(self._package)))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        found = super().get_command(ctx, name)
        if found is not None:
            return found
        module_path = discover(self._package).get(name)
        if module_path is None:
            return None
        module = importlib.import_module(module_path)
        # a package's helper modules (a fake server, a shared row) are no commands
        return getattr(module, "command", None)


def lazy_group(package: str, **kwargs):
    """Decorator building a :class:`LazyGroup` over ``package``."""
    return click.group(cls=LazyGroup, package=package, **kwargs)


def _log_level(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """``--log-level``: the package's log lines on stderr from this level up (the webhook
    receiver's too); httpx's request lines stay off, they carry credentials in URLs."""
    if value is not None:
        from .secrets import log_to_stderr

        log_to_stderr(value.upper())


@lazy_group("gpuhedge_celery.commands", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default=None,
    expose_value=False,
    callback=_log_level,
    help="Log the package's lines on stderr from this level up (default: warnings only).",
)
@click.option(
    "--redis-url",
    envvar="GPUHEDGE_REDIS_URL",
    default=None,
    help="Redis URL for broker, results and leases (env GPUHEDGE_REDIS_URL).",
)
@click.option(
    "--prefix",
    envvar="GPUHEDGE_PREFIX",
    default=None,
    help="Key prefix in Redis (env GPUHEDGE_PREFIX).",
)
@click.option(
    "--config",
    "config_path",
    envvar="GPUHEDGE_CONFIG",
    default=None,
    help="YAML config file (env GPUHEDGE_CONFIG; default ./config/gpuhedge.yaml, then packaged); "
    "a missing file is an error. `config check` validates it; `demo` runs its own unless "
    "--config is on the command line (then that file's policy and caps, simulated).",
)
@click.version_option(package_name="gpuhedge-celery")
@click.pass_context
def cli(ctx: click.Context, redis_url: str | None, prefix: str | None, config_path: str | None):
    """Celery-native GPU scheduling on Redis: GPU leases and hedged serverless races."""
    process_settings.reload()  # what this invocation's commands read: its environment now
    ctx.obj = CliContext(
        settings=Settings.from_env(redis_url=redis_url, prefix=prefix, config_path=config_path)
    )
    # An explicit config that is not there is an error for every command, never a silent
    # fallback (`config check FILE` names its own file and reports a missing one itself).
    if config_path and ctx.invoked_subcommand != "config" and not Path(config_path).is_file():
        raise ConfigError(
            "config file not found (from --config or GPUHEDGE_CONFIG)", file=config_path
        )


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: one-line errors with named exit codes, no tracebacks."""
    from .secrets import quiet_http_client_logs

    quiet_http_client_logs()
    try:
        code = cli.main(args=argv, prog_name="gpuhedge-celery", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return EXIT_FAILED
    except click.ClickException as e:
        e.show()
        return EXIT_USAGE
    except StoreUnavailable as e:
        click.echo(f"error: {e}", err=True)
        return EXIT_REDIS
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        return EXIT_USAGE
    except GpuHedgeError as e:
        click.echo(f"error: {e}", err=True)
        return EXIT_FAILED
    # A command's ``raise click.exceptions.Exit(n)`` comes back here as its return value.
    return code if isinstance(code, int) and not isinstance(code, bool) else EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
