"""``report --plot DIR`` and ``replay --plot FILE``: the PNGs are written and are images."""

from __future__ import annotations

import pathlib
import sys

from click.testing import CliRunner

from gpuhedge_celery.cli import cli
from tests.test_report import GPUHEDGE, OURS, write_jsonl

TRACES = str(pathlib.Path(__file__).parent / "data" / "moss_rounds.jsonl")
PNG = b"\x89PNG\r\n\x1a\n"


def read_png(path: pathlib.Path):
    """The image's pixels (matplotlib reads the file back: a truncated PNG fails here)."""
    import matplotlib.image  # in the test extra: this test must run, never skip

    assert path.read_bytes()[:8] == PNG
    return matplotlib.image.imread(str(path))


def test_report_plot_writes_a_cdf_and_a_box_plot(tmp_path):
    ours = write_jsonl(tmp_path / "ours.jsonl", OURS)
    theirs = write_jsonl(tmp_path / "gpuhedge.jsonl", GPUHEDGE)
    out = tmp_path / "plots" / "deep"  # created when missing
    result = CliRunner().invoke(
        cli, ["report", ours, theirs, "--deadline", "30", "--plot", str(out)],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    for name in ("latency_cdf.png", "latency_box.png"):
        pixels = read_png(out / name)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 500
        assert f"wrote {out / name}" in result.stderr
    # one box per group: five policies make the box plot taller than a two-group one
    two = tmp_path / "two"
    result = CliRunner().invoke(cli, ["report", ours, "--plot", str(two)], catch_exceptions=False)
    assert read_png(out / "latency_box.png").shape[0] > read_png(two / "latency_box.png").shape[0]


def test_report_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    ours = write_jsonl(tmp_path / "ours.jsonl", OURS)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes "import matplotlib" fail
    result = CliRunner().invoke(cli, ["report", ours, "--plot", str(tmp_path / "p")])
    assert result.exit_code == 2 and "plots need matplotlib" in result.output
    assert "[plot]" in result.output


def test_replay_plot_also_writes_a_box_plot(tmp_path):
    target = tmp_path / "cdf.png"
    result = CliRunner().invoke(
        cli, ["replay", TRACES, "--subset", "evaluation", "--policy", "single:runpod",
              "--policy", "cutover:runpod->cerebrium@q2.5s+s8.5s", "--plot", str(target)],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    read_png(target)
    box = read_png(tmp_path / "cdf_box.png")
    assert box.shape[0] > 200
    assert f"wrote {target} and {tmp_path / 'cdf_box.png'}" in result.stderr
