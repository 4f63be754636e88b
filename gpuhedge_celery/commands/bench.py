"""``gpuhedge-celery bench NAME``: benchmarks that print JSON (one module per benchmark)."""

from __future__ import annotations

from ..cli import lazy_group


@lazy_group("gpuhedge_celery.bench")
def command():
    """Run a benchmark and print JSON results (see docs/benchmarks.md)."""
