"""What ``bench races`` runs from a source checkout only: the RunPod fake (``benchmarks/fakes/``).

The fake is test scaffolding, so the installed package does not carry it. It is found next to
the package's own source (an editable install, or a run from the checkout), else anywhere on
``sys.path`` (a checkout on ``PYTHONPATH``); without one, the bench says so in one line.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import click

MODULE = "benchmarks.fakes.runpod_fake"
MISSING = (
    "the RunPod fake (benchmarks/fakes/) comes with a source checkout of gpuhedge-celery, not "
    "with the installed package: run this from a checkout (pip install -e .) or put one on "
    "PYTHONPATH"
)


def source_root() -> Path:
    """The folder above the package's source: a checkout's root when installed editable."""
    return Path(__file__).resolve().parents[2]


def runpod_fake() -> ModuleType:
    """The fake's module (``FakeRunpod``), or a one-line :class:`click.ClickException`."""
    root = source_root()
    if (root / "benchmarks" / "fakes" / "runpod_fake.py").is_file() and str(root) not in sys.path:
        sys.path.append(str(root))  # after everything else: nothing installed is shadowed
    try:
        return importlib.import_module(MODULE)
    except ModuleNotFoundError as exc:
        if exc.name not in ("benchmarks", "benchmarks.fakes", MODULE):
            raise  # the fake is there but something it needs is not
        raise click.ClickException(MISSING) from None
