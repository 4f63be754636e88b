"""``bench report`` runs and reports what it timed (its figures are in docs/benchmarks.md)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from gpuhedge_celery.bench.report import write_records
from gpuhedge_celery.cli import cli
from gpuhedge_celery.commands.report import load_files


def test_bench_report_times_report_over_the_records_it_generated():
    result = CliRunner().invoke(
        cli, ["bench", "report", "--records", "2000", "--repeat", "1"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)["results"]
    assert row["records"] == 2000 and row["in_process"]["requests"] == 2000
    assert row["in_process"]["total_s"] > 0 and len(row["command"]["wall_s_runs"]) == 1
    assert row["meets_target"] == (row["command"]["wall_s"] < row["target_s"] == 2.0)


def test_synthetic_records_are_read_as_both_formats(tmp_path):
    path = tmp_path / "r.jsonl"
    write_records(path, 1000, 0.2, seed=3)
    loaded = load_files([str(path)])
    # 800 of ours; 200 GPUHedge requests written as 400 lines (full + index), joined to 200
    assert loaded.sources() == {"gpuhedge-celery": 800, "gpuhedge": 200}
    assert loaded.skipped == {} and loaded.duplicates == 0
