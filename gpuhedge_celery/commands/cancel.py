"""``gpuhedge-celery cancel RACE_ID [--by NAME] [--wait S] [--json]``: stop a race in flight.

RACE_ID is the ``hedged_infer`` task id, or a prefix of it naming one race (like ``receipt``).
The stop is sent to the coordination workers (``gpuhedge.race_step``, on the broker of
``--redis-url`` / ``GPUHEDGE_BROKER_URL`` and ``GPUHEDGE_BROKER_PREFIX``): the caller's
``.get()`` raises ``RaceFailed`` (reason ``stopped``), every live job is cancelled through its
provider's native cancel with a receipt, nothing launches any more, and the race's receipt
names who stopped it (``stopped_by``, ``--by``, default ``cli``) and when (``stopped_at``).
Not to be confused with ``cancel-audit``, which measures providers' cancels.

Exit codes: 0 the race is stopped (now, or by an earlier stop: stopping twice is one stop);
1 nothing was stopped: no such race (unknown or expired), an ambiguous prefix, a race that had
already finished (won, failed or past its deadline), or a stop no coordination worker applied
within ``--wait`` (it stays queued and applies when one takes it); 2 bad input; 3 Redis
unreachable.
"""

from __future__ import annotations

import json

import click

from ..errors import ConfigError, GpuHedgeError

MAX_SHOWN = 5  # race ids an ambiguous prefix lists


def _resolve(store: object, race_id: str) -> str:
    """The one race id ``race_id`` names: itself when Redis knows it, else the one race whose
    id starts with it; GpuHedgeError (exit 1) for none or several."""
    from ..store.race_lookup import races_starting_with

    if store.load(race_id) is not None or store.receipt(race_id) is not None:  # type: ignore[attr-defined]
        return race_id
    matches = races_starting_with(store, race_id, limit=MAX_SHOWN + 1)
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        more = len(matches) > MAX_SHOWN
        count = f"more than {MAX_SHOWN}" if more else str(len(matches))
        shown = ", ".join(matches[:MAX_SHOWN]) + (", ..." if more else "")
        raise GpuHedgeError(
            f"race id prefix {race_id!r} matches {count} races ({shown}): give more characters"
        )
    raise GpuHedgeError(
        f"no race {race_id!r} under prefix {store.prefix!r} (no race id starts with it; "  # type: ignore[attr-defined]
        "unknown, not started yet, or expired): nothing stopped"
    )


@click.command(name="cancel")
@click.argument("race_id")
@click.option(
    "--by", default="cli", show_default=True, help="Who stops it, as the receipt's stopped_by says."
)
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(0),
    default=10.0,
    show_default=True,
    help="Seconds to wait for a coordination worker to apply the stop.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def command(race_id: str, by: str, wait_s: float, as_json: bool) -> None:
    """Stop a hedged race in flight: its caller fails, its jobs are cancelled natively
    (RACE_ID: the hedged_infer task id, or a prefix of it naming one race)."""
    from ..race.stop import check_by
    from ..store.connection import translate_errors
    from ..tasks.stop import send_stop
    from .race import celery_app
    from .receipt import _store

    by = check_by(by)
    try:
        store = _store()
        with translate_errors():
            race_id = _resolve(store, race_id)
            answer = send_stop(celery_app(), store, race_id, by, wait_s)
    except ValueError as e:  # a race id that could never be a key
        raise ConfigError(str(e), key="RACE_ID") from None
    click.echo(json.dumps(answer.to_dict(), indent=2) if as_json else answer.line())
    if not answer.ok:
        raise click.exceptions.Exit(1)
