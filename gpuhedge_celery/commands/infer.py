"""``gpuhedge-celery infer REQUEST [--policy NAME] --go``: one race, and its receipt.

The same race ``gpuhedge-celery race`` sends (REQUEST is a JSON object, ``-`` reads standard
input, ``@FILE`` a file), through the coordination workers of ``--redis-url``; once it has a
winner (or failed), the command waits for its final receipt (every loser's cancel settled) and
prints it as ``gpuhedge-celery receipt`` does. The finished race appends its record to the
records stream, so ``records export`` and ``report`` see it.

It can spend money: without ``--go`` the command prints the policy, each provider's worst case
and the request's worst-case spend and exits 2, sending nothing. Exit codes: 0 a winner, 1 the
race failed (its receipt is still printed), 2 a dry run or bad input, 3 Redis unreachable.
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from ..errors import RaceFailed
from .race import gated_race, race_options

RECEIPT_WAIT_S = 30.0  # after the result: the losers' cancels confirm within this


def final_receipt(race_id: str, wait_s: float = RECEIPT_WAIT_S) -> dict[str, Any] | None:
    """The race's receipt once it is final (every attempt settled), else the latest provisional
    one after ``wait_s`` seconds (None if the race is unknown)."""
    from ..race.receipt import read_receipt
    from ..store.connection import translate_errors
    from .receipt import _store

    store = _store()
    deadline = time.monotonic() + wait_s
    with translate_errors():
        while True:
            found = read_receipt(store, race_id)
            if (found is not None and found.get("finished")) or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)


@click.command(name="infer")
@race_options
@click.option("--json", "as_json", is_flag=True, help="Print the receipt as JSON.")
def command(as_json: bool, **ask: Any) -> None:
    """Race REQUEST once on the workers and print its receipt; a dry run unless --go."""
    from .receipt import render

    send = gated_race(**ask)

    failed: RaceFailed | None = None
    try:
        race_id = send()["race_id"]
    except RaceFailed as e:
        failed, race_id = e, e.race_id
    receipt = final_receipt(race_id)
    if receipt is None:  # the receipt expired or was never written: say what is known
        click.echo(f"race {race_id}: no receipt found", err=True)
    elif as_json:
        click.echo(json.dumps(receipt, indent=2))
    else:
        click.echo(render(receipt))
    if failed is not None:
        click.echo(f"race {race_id} failed ({failed.reason}): {failed}", err=True)
        raise click.exceptions.Exit(1)
