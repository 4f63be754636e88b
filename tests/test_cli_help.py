"""``--help`` of every command and sub-command of ``gpuhedge-celery`` works (exit 0, usage shown).

The commands are discovered (``cli.LazyGroup``: one module per command, a package per group), so
the tree is walked here, not listed: a module added without a ``command``, or a command whose
help text cannot be rendered, fails here.
"""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from gpuhedge_celery.cli import cli


def command_paths() -> list[tuple[str, ...]]:
    """Every command's path below the root (the root itself as ``()``)."""
    paths: list[tuple[str, ...]] = []

    def walk(group: click.Command, path: tuple[str, ...]) -> None:
        paths.append(path)
        if not isinstance(group, click.Group):
            return
        ctx = click.Context(group, info_name=path[-1] if path else "gpuhedge-celery")
        for name in group.list_commands(ctx):
            try:
                found = group.get_command(ctx, name)
            except Exception:  # its own --help below shows the error
                paths.append((*path, name))
                continue
            if found is not None:
                walk(found, (*path, name))

    walk(cli, ())
    return paths


PATHS = command_paths()


def test_the_walk_finds_the_groups_and_their_commands():
    assert ("bench",) in PATHS and ("bench", "races") in PATHS and ("race",) in PATHS
    assert ("bench", "celery-floor") not in PATHS  # a helper module of bench, no command


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "gpuhedge-celery")
def test_help(path):
    result = CliRunner().invoke(cli, [*path, "--help"], prog_name="gpuhedge-celery")
    assert result.exit_code == 0, f"{' '.join(path)} --help: {result.output}{result.exception!r}"
    assert result.output.startswith(f"Usage: gpuhedge-celery {' '.join(path)}".rstrip())
