"""``gpuhedge-celery bench races --provider runpod-fake`` with tiny counts: the JSON shape and the
fake's own request counts, not the figures (those are docs/benchmarks.md's)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.timeout(240)


def test_the_runpod_row_runs_beside_the_sim_row_and_counts_requests(redis_url):
    script = shutil.which("gpuhedge-celery")
    assert script, "gpuhedge-celery is not installed (pip install -e .)"
    argv = [script, "--redis-url", redis_url, "bench", "races", "--json", "--rows", "capacity",
            "--races", "12", "--duration-s", "3", "--workers", "1",
            "--provider", "runpod-fake"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stderr[-3000:]
    sim, rp = json.loads(done.stdout)["results"]
    assert (sim["provider"], rp["provider"]) == ("sim", "runpod-fake")
    for row in (sim, rp):
        assert row["races"] == row["finished"] == row["won"] == 12 and row["leaks"] == 0
    assert rp["hedged"] == sim["hedged"]  # the same fates on both
    counts = rp["runpod"]
    assert counts["webhooks"] == "off" and counts["never_over_limit"] is True
    # every race submits its primary once, and every hedge once: nothing was submitted twice
    assert counts["provider_jobs"] == 12 + rp["hedged"]
    assert counts["requests_per_job_by_route"]["run"] == 1.0
    assert counts["requests_per_job"] > 1.0  # jobs are polled (webhooks off)
    assert counts["routes"]["bench-p status"]["max_in_window"] <= 2000
    assert rp["cpu_vs_sim"] > 0 and rp["cpu_ms_per_race_with_fake"] >= rp["cpu_ms_per_race"]


def test_with_webhooks_on_every_runpod_job_reports_its_end_by_webhook_to_two_receivers(redis_url):
    script = shutil.which("gpuhedge-celery")
    assert script, "gpuhedge-celery is not installed (pip install -e .)"
    argv = [script, "--redis-url", redis_url, "bench", "races", "--json", "--rows", "capacity",
            "--races", "10", "--duration-s", "3", "--workers", "1",
            "--provider", "runpod-fake", "--webhooks", "on", "--receiver-workers", "2"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, done.stderr[-3000:]
    sim, rp = json.loads(done.stdout)["results"]
    assert rp["races"] == rp["won"] == 10 and rp["leaks"] == 0
    assert rp["cpu_ms_per_race_by"]["receiver"] > 0 and sim["setup"]["webhooks"] == "on"
    counts = rp["runpod"]
    assert counts["webhooks"] == "on" and counts["never_over_limit"] is True
    assert counts["receiver_processes"] == sim["setup"]["receiver_processes"] == 2
    # every job's end was delivered once, at the first try, and the receiver took each
    deliveries = counts["webhook_deliveries"]
    assert deliveries["sent"] == deliveries["attempts"] == counts["provider_jobs"]
    assert deliveries["codes"] == {"200": counts["provider_jobs"]}
