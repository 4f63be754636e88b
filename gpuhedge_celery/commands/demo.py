"""``gpuhedge-celery demo``: hedged races and a GPU pool on a laptop, simulated, no spend."""

from __future__ import annotations

import json
from dataclasses import asdict

import click


@click.command(name="demo")
@click.option("--races", default=15, show_default=True, help="Requests per policy in the batch.")
@click.option("--pool-jobs", default=6, show_default=True, help="Jobs sent to the demo GPU pool.")
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
def command(races: int, pool_jobs: int, as_json: bool, plot_dir: str | None) -> None:
    """Run simulated providers through single, fixed, state_aware and cascade races on real
    Celery workers, then a CPU-runner GPU pool; print what happened and a summary.

    Without --redis-url / GPUHEDGE_REDIS_URL it runs on an embedded, simulated Redis (fakeredis),
    so nothing needs installing.
    """
    from ..demo.run import run_demo
    from ..store.connection import ping

    root = click.get_current_context().find_root()
    explicit_url = root.params.get("redis_url")
    embedded = None
    if explicit_url:
        url = root.obj.settings.redis_url
        ping(url)  # StoreUnavailable -> one line, exit code 3
    else:
        from ..store.embedded import spawn_embedded_redis

        embedded = spawn_embedded_redis()
        url = embedded.url
    try:
        # With --json the narrative goes to stderr so stdout is one JSON document.
        echo = (lambda line: click.echo(line, err=True)) if as_json else click.echo
        report = run_demo(
            url,
            embedded=embedded is not None,
            races=races,
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
