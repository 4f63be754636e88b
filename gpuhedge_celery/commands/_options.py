"""Click options written once for the commands that take them alike.

:func:`shown` is ``click.option`` with the default shown in ``--help``; :data:`providers_option`
and :func:`request_option` are options several commands share, so their names, defaults and help
read the same in each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def shown(*decls: str, **attrs: Any) -> Callable[[F], F]:
    """``click.option(*decls, **attrs)`` whose ``--help`` shows its default."""
    return click.option(*decls, show_default=True, **attrs)


providers_option = click.option(
    "--providers",
    "names",
    default=None,
    help="Comma-separated provider names [default: every deployed provider].",
)


def request_option(what: str) -> Callable[[F], F]:
    """``--request`` (``request_text``, default ``{}``); ``what`` opens its help."""
    return shown(
        "--request",
        "request_text",
        default="{}",
        help=f"{what}: JSON, @FILE or - (standard input).",
    )
