"""``gpuhedge-celery gpus drain|undrain HOST[:GPU]``: take GPUs out of the pool for maintenance.

A draining GPU takes no new lease (the claim scripts check it in the same step as the lease) and
finishes the job it runs. ``drain`` returns once every GPU it names is idle (no lease, no running
job), or at once with ``--no-wait``; ``undrain`` puts them back, unless another reason still keeps
one out (its model is not loaded, a foreign process holds its memory), which it then names.
"""

from __future__ import annotations

import time

import click

from .leases import _store

EXIT_TIMEOUT = 1


def _targets(store, target: str) -> list[str]:
    from ..store.availability import resolve_targets

    return [g.gpu_id for g in resolve_targets(store, target)]


@click.group(name="gpus")
def command() -> None:
    """Drain GPUs for maintenance and put them back (the lease table shows both)."""


@command.command("drain")
@click.argument("target", metavar="HOST[:GPU]")
@click.option("--no-wait", is_flag=True, help="Return at once instead of when the GPUs are idle.")
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=None,
    metavar="S",
    help="Give up waiting after S seconds (exit 1; the GPUs stay drained).",
)
@click.option("--reason", default="drained by an operator", show_default=True, metavar="TEXT")
def drain_command(target: str, no_wait: bool, timeout_s: float | None, reason: str) -> None:
    """Take HOST's GPUs (or one, HOST:GPU) out of the pool; wait until their jobs finish."""
    from ..store.availability import busy, drain

    store = _store()
    gpu_ids = _targets(store, target)
    drain(store, gpu_ids, reason)
    click.echo(f"draining {', '.join(gpu_ids)}: no new leases")
    if no_wait:
        return
    started = time.monotonic()
    reported: list[str] = []
    while left := busy(store, gpu_ids):
        if left != reported:
            click.echo(f"waiting for the job(s) on {', '.join(left)} to finish")
            reported = left
        if timeout_s is not None and time.monotonic() - started >= timeout_s:
            click.echo(f"still busy after {timeout_s:g} s: {', '.join(left)} (left drained)")
            raise SystemExit(EXIT_TIMEOUT)
        time.sleep(0.1)
    click.echo(f"drained {', '.join(gpu_ids)}: idle ({time.monotonic() - started:.1f} s)")


@command.command("undrain")
@click.argument("target", metavar="HOST[:GPU]")
def undrain_command(target: str) -> None:
    """Put drained (or faulted) GPUs back into the pool."""
    from ..store.availability import out_reasons, undrain

    store = _store()
    for gpu_id, back in undrain(store, _targets(store, target)).items():
        if back:
            click.echo(f"{gpu_id}: back in the pool")
            continue
        still = "; ".join(f"{k}: {v['detail']}" for k, v in out_reasons(store, gpu_id).items())
        click.echo(f"{gpu_id}: undrained, still out of the pool ({still})")
