"""The demo ends with the ``report`` table of the races it ran, and writes its plots on request."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.test_report_plots import read_png


def test_demo_prints_the_report_of_its_races_and_writes_its_plots(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUHEDGE_")}
    plots = tmp_path / "plots"
    argv = [sys.executable, "-m", "gpuhedge_celery", "demo", "--races", "2", "--pool-jobs", "2",
            "--json", "--plot", str(plots)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    rows = report["records_report"]
    # every race the demo ran: 5 scenarios, 2 per policy in the batch, 2 pool-primary races
    ran = len(report["scenarios"]) + sum(r["n"] for r in report["summary"])
    ran += len(report["pool_races"])
    assert sum(r["n"] for r in rows) == ran == 5 + 4 * 2 + 2
    assert all(r["leaks"] == 0 for r in rows)
    assert all(r["active_usd_per_request"] is not None for r in rows)  # our records: priced
    assert any(r["hedge_rate"] > 0 for r in rows)
    # the narrative (stderr with --json) ends with the table, one line per policy
    narrative = proc.stderr
    section = narrative[narrative.index("== 5. The report of every race above") :]
    for row in rows:
        assert f"  {row['group'][:48]}" in section or row["group"][:47] in section
    for name in ("latency_cdf.png", "latency_box.png"):
        read_png(plots / name)
