"""``gpuhedge-celery demo``: hedged races and a GPU pool on a laptop, simulated, no spend.

``demo --config FILE`` runs FILE's own policy, timeouts and budget caps instead, each of its
providers stood in by a simulated one (:mod:`gpuhedge_celery.demo.config_run`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

import click
from click.core import ParameterSource

from ..errors import ConfigError

CONFIG_RACES = 6  # races of `demo --config` when --races is not given


def _config_path(local: str | None) -> str | None:
    """The config ``demo`` runs: ``demo --config``, else a ``--config`` given before ``demo``
    on the command line (GPUHEDGE_CONFIG alone keeps the packaged demo)."""
    if local:
        return local
    root = click.get_current_context().find_root()
    if root.get_parameter_source("config_path") is ParameterSource.COMMANDLINE:
        return root.params.get("config_path")
    return None


@click.command(name="demo")
@click.option(
    "--races",
    default=None,
    type=click.IntRange(min=1),
    help=f"Requests per policy in the batch (15); with --config, races ({CONFIG_RACES}).",
)
@click.option("--pool-jobs", default=6, show_default=True, help="Jobs sent to the demo GPU pool.")
@click.option(
    "--config",
    "config_path",
    default=None,
    metavar="FILE",
    help="Run FILE's policy and budget caps with every provider simulated (no spend).",
)
@click.option(
    "--redis-url",
    default=None,
    metavar="URL",
    help="Run on this Redis instead of the embedded one (as the global --redis-url).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the measured figures as JSON at the end."
)
@click.option(
    "--plot",
    "plot_dir",
    default=None,
    metavar="DIR",
    help="Write the final report's latency plots (PNG) here.",
)
def command(
    races: int | None,
    pool_jobs: int,
    config_path: str | None,
    redis_url: str | None,
    as_json: bool,
    plot_dir: str | None,
) -> None:
    """Run simulated providers through single, fixed, state_aware and cascade races on real
    Celery workers, then a CPU-runner GPU pool; print what happened and a summary.

    With --config FILE: races with FILE's policy, timeouts and budget caps, each provider
    stood in by a simulated one with its rate, idle window and cap; the simulated primary is
    slow in about half of them, so the hedge launches there. Prints each race's hedge, winner
    and the loser's cancel receipt, and any attempt the budget refused.

    Without --redis-url / GPUHEDGE_REDIS_URL it runs on an embedded, simulated Redis (fakeredis),
    so nothing needs installing.
    """
    from .. import envvars
    from ..redis_url import is_cluster
    from ..store.connection import ping
    from ..store.embedded import spawn_embedded_redis

    root = click.get_current_context().find_root()
    file = _config_path(config_path)
    if file is not None:
        from pathlib import Path

        if not Path(file).is_file():
            raise ConfigError("config file not found (from demo --config)", file=file)
        from ..config import load_config

        load_config(file)  # a broken file: one line, exit code 2, before anything starts
    url = redis_url or root.params.get("redis_url")
    embedded = None
    if url:
        url = redis_url or root.obj.settings.redis_url
        ping(url)  # StoreUnavailable -> one line, exit code 3
        if is_cluster(url) and not os.environ.get(envvars.BROKER_URL_VAR):
            raise ConfigError(
                "the demo's store is a Redis Cluster, which Celery cannot use: set it to a "
                "Redis of its own for the broker and Celery's results",
                key=envvars.BROKER_URL_VAR,
            )
    else:
        embedded = spawn_embedded_redis()
        url = embedded.url
    # With --json the narrative goes to stderr so stdout is one JSON document.
    echo = (lambda line: click.echo(line, err=True)) if as_json else click.echo
    report: Any
    try:
        if file is not None:
            from ..demo.config_run import run_config_demo

            report = run_config_demo(
                url,
                embedded=embedded is not None,
                config_path=file,
                races=races or CONFIG_RACES,
                echo=echo,
            )
        else:
            from ..demo.run import run_demo

            report = run_demo(
                url,
                embedded=embedded is not None,
                races=races or 15,
                pool_jobs=pool_jobs,
                echo=echo,
                plot_dir=plot_dir,
            )
    finally:
        if embedded is not None:
            embedded.stop()
    if as_json:
        click.echo(json.dumps(asdict(report), indent=2, default=str))
    else:
        click.echo(f"demo finished in {report.wall_s:.1f} s")
