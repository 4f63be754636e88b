"""``gpuhedge-celery traces synth SPEC.yaml -o OUT.jsonl``: write synthetic paired-round traces
(regime shifts included) that ``replay`` reads; the spec format is in providers/sim_traces.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError


class BadInput(click.ClickException):
    """A one-line usage error (exit code 2)."""

    exit_code = 2


def load_spec(path: str) -> Any:
    """The YAML document at ``path`` (duplicate keys refused); a one-line ConfigError."""
    import yaml

    from ..config import _StrictLoader

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read spec ({e.strerror or e})", file=path) from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"invalid YAML{where}: {problem}", file=path) from None


@click.group(name="traces")
def command() -> None:
    """Write paired-round traces for `replay` (docs/policies.md)."""


@command.command(name="synth")
@click.argument("spec_path", metavar="SPEC.yaml")
@click.option(
    "-o",
    "--out",
    "out_path",
    required=True,
    help="Traces file to write (replaced if it exists); '-' for stdout.",
)
def synth(spec_path: str, out_path: str) -> None:
    """Draw the rounds SPEC.yaml describes with the sim's seeded fates and write them as JSON
    lines. Same spec, same file. Prints one summary line to stderr: rounds written, and each
    provider's valid count and valid p50/p95 wall before and after each shift."""
    from ..providers.sim_traces import parse_spec, summary, synth_rounds

    try:
        spec = parse_spec(load_spec(spec_path), spec_path)
    except ConfigError as e:
        raise BadInput(str(e)) from None
    records = synth_rounds(spec)
    text = "".join(json.dumps(r) + "\n" for r in records)
    if out_path == "-":
        sys.stdout.write(text)
    else:
        try:
            Path(out_path).write_text(text, encoding="utf-8")
        except OSError as e:
            raise BadInput(f"cannot write traces {out_path!r}: {e.strerror or e}") from None
    click.echo(f"wrote {out_path}: {summary(records, spec.shift_rounds)}", err=True)
