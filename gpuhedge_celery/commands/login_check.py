"""``gpuhedge-celery login-check [--json]``: one read-only authenticated call per provider.

For every provider of the config (deployed or not) the adapter's ``login_check()`` makes one
read-only call (``providers/account_checks.py``: a status probe, a function lookup, an app
read, the pool's GPUs; a sim needs none) and the command prints a table: provider, status,
identity, detail. It never prints a secret. Exit code 0 only when every provider is ``ok``; 1
otherwise; 2 a bad config.
"""

from __future__ import annotations

import json

import click

from ..providers.account import FAILED, LoginCheck


@click.command(name="login-check")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def command(as_json: bool) -> None:
    """Check every configured provider's credentials with one read-only call each."""
    from ..cli import root_config
    from ._accounts import build_for_command, one_line, secrets_of

    cfg = root_config()
    secrets = secrets_of(cfg)
    checks: list[LoginCheck] = []
    for name in cfg.providers:
        try:
            check = build_for_command(cfg, name).login_check()
        except Exception as e:  # a missing ${VAR}, an adapter bug: one row, never a traceback
            check = LoginCheck(name, FAILED, "", f"{type(e).__name__}: {e}")
        checks.append(
            LoginCheck(
                check.provider,
                check.status,
                one_line(check.identity, secrets),
                one_line(check.detail, secrets),
            )
        )
    if as_json:
        click.echo(json.dumps([c.to_dict() for c in checks], indent=2))
    else:
        width = max([len(c.provider) for c in checks] + [8])
        click.echo(f"{'provider':<{width}}  {'status':<11}  {'identity':<32}  detail")
        for c in checks:
            click.echo(f"{c.provider:<{width}}  {c.status:<11}  {c.identity:<32}  {c.detail}")
    if not checks or not all(c.ok for c in checks):
        raise click.exceptions.Exit(1)
