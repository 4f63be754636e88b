"""``gpuhedge-celery webhooks [--host H] [--port P] [--workers N]``: the webhook receiver.

Providers POST a job's end to ``GPUHEDGE_WEBHOOK_URL/{race}/{attempt}/{token}``; this serves
those deliveries (uvicorn, plain HTTP: run it behind the operator's TLS ingress) and applies
each to its race in Redis. Needs ``GPUHEDGE_WEBHOOK_SECRET`` (the same as the workers'), the
Redis URL, prefix and config of the workers. ``GET /healthz`` answers 200. ``--workers N``
runs N receiver processes on the one port (``SO_REUSEPORT``; see
:mod:`gpuhedge_celery.webhooks.serve`). See docs/providers.md.
"""

from __future__ import annotations

import sys

import click

from ..errors import ConfigError


@click.command("webhooks")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option(
    "--port", default=8088, show_default=True, type=click.IntRange(0, 65535), help="TCP port."
)
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Receiver processes sharing the port (each applies deliveries with its "
    "own Redis clients); about one per core the receiver may use.",
)
@click.option(
    "--threads",
    default=16,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Threads applying deliveries, per process (each waits on Redis).",
)
def command(host: str, port: int, workers: int, threads: int) -> None:
    """Serve provider webhooks: each delivery becomes its race's event, saved before the reply."""
    try:
        import uvicorn  # noqa: F401 - present, or say which extra brings it
    except ImportError:
        raise ConfigError(
            "the webhook receiver needs uvicorn: pip install 'gpuhedge-celery[webhooks]'",
            key="webhooks",
        ) from None
    from .. import settings as process_settings
    from ..webhooks.serve import serve

    settings = process_settings.current().webhooks
    if not settings.secret:
        raise ConfigError(
            "is not set: the receiver cannot check tokens", key="GPUHEDGE_WEBHOOK_SECRET"
        )
    if workers > 1 and port == 0:
        raise click.BadParameter(
            "needs a fixed --port (each process binds it)", param_hint="--workers"
        )
    click.echo(
        f"gpuhedge-celery webhooks: listening on http://{host}:{port}"
        + (f" ({workers} processes)" if workers > 1 else ""),
        err=True,
    )
    sys.exit(serve(host, port, workers=workers, threads=threads))
