"""The ``--go`` gate of every command that can spend money.

Without ``--go`` such a command prints what it would do and its worst-case spend, sends
nothing, and exits with code 2; with ``--go`` it runs. A command opts in with :func:`go_option`
on its click command and calls :func:`gate` before it spends anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import click

EXIT_DRY_RUN = 2


def go_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--go``: really send what the command would send (it may spend money)."""
    return click.option(
        "--go", is_flag=True, help="Really do it (it may spend money); without it: a dry run."
    )(fn)


def gate(go: bool, plan: Iterable[str], worst_usd: float) -> None:
    """Return when ``go``; otherwise print ``plan`` and the worst case, and exit 2."""
    if go:
        return
    for line in plan:
        click.echo(line)
    click.echo(f"worst-case spend: ${worst_usd:,.4f}")
    click.echo("dry run: nothing was sent; add --go to do it", err=True)
    raise click.exceptions.Exit(EXIT_DRY_RUN)
