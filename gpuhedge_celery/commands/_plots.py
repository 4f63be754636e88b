"""PNG plots shared by ``report`` and ``replay``: latency CDFs and box plots, one per group.

matplotlib is imported only when a plot is asked for (``pip install 'gpuhedge-celery[plot]'``),
with the Agg backend: files only, never a window.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click


class PlotError(click.ClickException):
    """A one-line plotting error (exit code 2)."""

    exit_code = 2


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend; a one-line error when it is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("plots need matplotlib: pip install 'gpuhedge-celery[plot]'") from None
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


def box_path(path: str | Path) -> Path:
    """The box plot's file beside a CDF plot written to ``path``: ``x.png`` -> ``x_box.png``."""
    p = Path(path)
    return p.with_name(f"{p.stem}_box{p.suffix or '.png'}")


def save(fig: Any, plt: Any, path: str | Path) -> None:
    try:
        fig.savefig(str(path), dpi=110)
    except OSError as e:
        raise PlotError(f"cannot write plot {str(path)!r}: {e.strerror}") from None
    finally:
        plt.close(fig)


def _wide(groups: Mapping[str, Sequence[float]]) -> bool:
    """Whether finite latencies span enough to want a log axis."""
    finite = [v for vs in groups.values() for v in vs if not math.isinf(v) and v > 0]
    return bool(finite) and max(finite) / min(finite) > 30


def write_cdf(
    path: str | Path,
    groups: Mapping[str, Sequence[float]],
    deadlines: Sequence[float],
    title: str,
    *,
    unit: str = "s",
) -> None:
    """A latency CDF per group (failed requests, +inf, keep the curve below 1), deadlines marked."""
    plt = pyplot()
    colours = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20").colors
    fig, ax = plt.subplots(figsize=(10, 6))
    for i, (name, values) in enumerate(groups.items()):
        n = len(values)
        finite = sorted(v for v in values if not math.isinf(v))
        if not finite:
            continue
        xs = [finite[0], *finite]  # the curve rises from 0 at the first answer
        ys = [0.0, *((k + 1) / n for k in range(len(finite)))]
        label = f"{name} (n={n}{f', {n - len(finite)} failed' if len(finite) < n else ''})"
        ax.step(xs, ys, where="post", label=label, color=colours[i % len(colours)], lw=1.6)
    for d in deadlines:
        ax.axvline(d, color="black", linestyle="--", linewidth=1)
        ax.annotate(f"deadline {d:g} {unit}", (d, 1.0), xytext=(3, -12), textcoords="offset points")
    if _wide(groups):
        ax.set_xscale("log")
    ax.set_xlabel(f"latency ({unit})")
    ax.set_ylabel("fraction of requests answered")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save(fig, plt, path)


def write_box(
    path: str | Path,
    groups: Mapping[str, Sequence[float]],
    deadlines: Sequence[float],
    title: str,
    *,
    unit: str = "s",
) -> None:
    """A horizontal box plot per group of finite latencies (failed requests counted in the
    label), whiskers at 1.5 IQR, deadlines marked."""
    plt = pyplot()
    names = list(groups)
    data, labels = [], []
    for name in names:
        values = groups[name]
        finite = [v for v in values if not math.isinf(v)]
        failed = len(values) - len(finite)
        data.append(finite or [math.nan])
        labels.append(f"{name}\n(n={len(values)}{f', {failed} failed' if failed else ''})")
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.55 * len(names) + 1.5)))
    positions = list(range(1, len(names) + 1))
    if "orientation" in inspect.signature(ax.boxplot).parameters:  # matplotlib >= 3.10
        ax.boxplot(data, orientation="horizontal", positions=positions, showfliers=True)
    else:
        ax.boxplot(data, vert=False, positions=positions, showfliers=True)
    ax.set_yticks(positions)
    ax.set_yticklabels(labels)
    for d in deadlines:
        ax.axvline(d, color="black", linestyle="--", linewidth=1)
    if _wide(groups):
        ax.set_xscale("log")
    ax.invert_yaxis()  # the first group on top
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel(f"latency ({unit}); dashed: deadline")
    ax.set_title(title)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    save(fig, plt, path)
