"""``gpuhedge-celery metrics serve|list``: the Redis gauges for Prometheus, and the metric list.

``serve`` answers every scrape by reading the deployment's gauges from Redis (GPUs per pool and
state, waiters, races in flight, timer backlog, and, when the config sets a budget cap, each
budget scope's reserved, spent and headroom; :mod:`gpuhedge_celery.metrics.redis_gauges`).
Counters and latency histograms come from each worker's own endpoint
(``GPUHEDGE_METRICS_PORT``). ``list`` prints every metric either one exports. docs/metrics.md
says what each one means. Exit codes: 0 ok, 2 bad option or ``prometheus_client`` missing.
"""

from __future__ import annotations

import json

import click

from ..metrics.definitions import ALL_METRICS, COUNTER
from ._options import shown


@click.group(name="metrics")
def command() -> None:
    """Prometheus metrics (docs/metrics.md)."""


@command.command(name="serve")
@shown(
    "--port",
    type=click.IntRange(0, 65535),
    default=9540,
    help="TCP port (0: any free port, printed at start).",
)
@shown("--addr", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface).")
@shown(
    "--stale-s",
    type=click.FloatRange(0, min_open=True),
    default=30.0,
    help="A race whose heartbeat is older counts as stale (the janitor's threshold, "
    "GPUHEDGE_JANITOR_STALE_S).",
)
@shown(
    "--timer-namespace",
    "namespaces",
    multiple=True,
    default=(),
    help="Durable-timer namespace to report; repeat for several (default: every race shard's, "
    "from GPUHEDGE_TIMER_NAMESPACE and GPUHEDGE_RACE_SHARDS).",
)
def serve(port: int, addr: str, stale_s: float, namespaces: tuple[str, ...]) -> None:
    """Serve the gauges Redis holds on /metrics, read at each scrape, until interrupted."""
    from ..cli import cli_redis_client, root_config, root_settings
    from ..errors import ConfigError
    from ..metrics.exposition import INSTALL_HINT, make_http_server
    from ..metrics.redis_gauges import RedisGauges
    from ..settings import current

    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        raise ConfigError(f"metrics need prometheus_client: {INSTALL_HINT}") from None
    cfg = root_config()  # its budget caps and providers (the budget gauges)
    root = root_settings()
    try:
        collector = RedisGauges(
            cli_redis_client(),
            root.prefix,
            namespaces=namespaces or None,
            shards=current().race_shards(root.prefix, root.redis_url),
            stale_s=stale_s,
            budget=cfg.budget,
            providers=list(cfg.providers),
        )
    except ValueError as e:  # a timer namespace that cannot be part of a key
        raise ConfigError(str(e), key="--timer-namespace") from None
    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    try:
        server = make_http_server(registry, addr, port)
    except OSError as e:
        raise ConfigError(f"cannot listen on {addr}:{port}: {e.strerror}", key="--port") from None
    bound = server.server_address[1]
    click.echo(
        f"serving Redis gauges of prefix {collector.prefix!r} on http://{addr}:{bound}/metrics",
        err=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


@command.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
def list_command(as_json: bool) -> None:
    """Every metric: name, type, source (worker endpoint or metrics serve), labels, help."""
    if as_json:
        rows = [
            {
                "name": m.name,
                "type": m.kind,
                "source": m.source,
                "labels": list(m.labels),
                "samples": list(m.samples()),
                "help": m.help,
            }
            for m in ALL_METRICS
        ]
        click.echo(json.dumps(rows, indent=2))
        return
    for m in ALL_METRICS:
        labels = "{" + ",".join(m.labels) + "}" if m.labels else ""
        shown = m.samples()[0] if m.kind == COUNTER else m.name
        click.echo(f"{shown}{labels}  {m.kind}, {m.source}: {m.help}")
