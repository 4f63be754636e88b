"""``gpuhedge-celery leases``: the table, suggest-ttl, set-ttl, enable-events, one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from gpuhedge_celery.cli import EXIT_FAILED, EXIT_REDIS, EXIT_USAGE, cli, main
from tests.support.fixtures_leases import add_pool
from tests.support.redis_server import free_port

pytestmark = pytest.mark.usefixtures("listeners_closed")


def run(redis_url, prefix, *args):
    return CliRunner().invoke(cli, ["--redis-url", redis_url, "--prefix", prefix, *args])


def one_line_error(capsys, redis_url, prefix, *args):
    code = main(["--redis-url", redis_url, "--prefix", prefix, *args])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    return code, lines[0]


def test_table_text_and_json(lease_store, redis_url, prefix):
    add_pool(lease_store, "default", 2, host="gpu-a")
    lease = lease_store.try_claim("gpu-a:0", "task-123", ttl_ms=20_000)
    text = run(redis_url, prefix, "leases")
    assert text.exit_code == 0, text.output
    lines = text.output.splitlines()
    assert lines[0].split()[:4] == ["GPU", "POOL", "HOST", "STATE"]
    held = next(line for line in lines if line.startswith("gpu-a:0"))
    assert "held" in held and "task-123" in held and str(lease.token) in held and "ago" in held
    assert "free" in next(line for line in lines if line.startswith("gpu-a:1"))
    out = run(redis_url, prefix, "leases", "--json", "--pool", "default")
    data = json.loads(out.output)
    rows = {r["gpu_id"]: r for r in data["gpus"]}
    assert rows["gpu-a:0"]["state"] == "held" and rows["gpu-a:0"]["token"] == lease.token
    assert 0 < rows["gpu-a:0"]["ttl_left_ms"] <= 20_000 and rows["gpu-a:0"]["since"]
    assert rows["gpu-a:1"]["state"] == "free" and rows["gpu-a:1"]["holder"] is None


def test_suggest_ttl_from_file_and_pool(lease_store, redis_url, prefix, tmp_path):
    path = tmp_path / "durations.txt"
    path.write_text("\n".join(["10"] * 98 + ["20", '{"duration_s": 40}']) + "\n")
    out = run(redis_url, prefix, "leases", "suggest-ttl", "--from", str(path), "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["ttl_ms"] == 30_000 and data["percentile"] == 99 and data["margin"] == 1.5
    text = run(redis_url, prefix, "leases", "suggest-ttl", "--from", str(path))
    assert "30000 ms" in text.output and "p99 of 100" in text.output and "why:" in text.output
    for d in (2.0, 3.0, 4.0):
        lease_store.record_duration("gpu", d)
    out = run(redis_url, prefix, "leases", "suggest-ttl", "--pool", "gpu", "--json")
    assert json.loads(out.output)["ttl_ms"] == 6_000  # few samples: max 4 s x 1.5


def test_set_ttl(lease_store, redis_url, prefix):
    out = run(redis_url, prefix, "leases", "set-ttl", "--pool", "p", "--ttl-ms", "4500")
    assert out.exit_code == 0 and lease_store.pool_ttl("p") == 4500


def test_bad_input_one_line_errors(capsys, lease_store, redis_url, prefix, tmp_path):
    add_pool(lease_store, "empty", host="gone", heartbeat_ms=1)
    code, line = one_line_error(capsys, redis_url, prefix, "leases", "--pool", "nope")
    assert code == EXIT_FAILED and "unknown pool 'nope'" in line
    code, line = one_line_error(
        capsys, redis_url, prefix, "leases", "set-ttl", "--pool", "p", "--ttl-ms", "0"
    )
    assert code == EXIT_USAGE and "ttl_ms" in line and "> 0" in line
    bad = tmp_path / "bad.txt"
    bad.write_text("1.5\nsoon\n")
    code, line = one_line_error(
        capsys, redis_url, prefix, "leases", "suggest-ttl", "--from", str(bad)
    )
    assert code == EXIT_USAGE and "line 2" in line and str(bad) in line
    code, line = one_line_error(capsys, redis_url, prefix, "leases", "suggest-ttl", "--pool", "x")
    assert code == EXIT_USAGE and "no job durations" in line
    code, line = one_line_error(capsys, redis_url, prefix, "leases", "suggest-ttl")
    assert code == EXIT_USAGE and "exactly one" in line
    dead = f"redis://127.0.0.1:{free_port()}/0"
    code, line = one_line_error(capsys, dead, prefix, "leases")
    assert code == EXIT_REDIS and "unreachable" in line


def test_enable_events(capsys, private_redis, silent_redis):
    out = CliRunner().invoke(cli, ["--redis-url", private_redis.url, "leases", "enable-events"])
    assert out.exit_code == 0 and "notify-keyspace-events=" in out.output
    code, line = one_line_error(capsys, silent_redis.url, "p", "leases", "enable-events")
    assert code == EXIT_FAILED and "parameter group" in line and "CONFIG" in line


def test_entry_point(lease_store, redis_url, prefix):
    add_pool(lease_store, "default", 1, host="ep")
    exe = shutil.which("gpuhedge-celery")
    assert exe, "the console script is not installed (pip install -e .)"
    env = dict(os.environ, GPUHEDGE_REDIS_URL=redis_url, GPUHEDGE_PREFIX=prefix)
    proc = subprocess.run(
        [exe, "leases", "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["gpus"][0]["gpu_id"] == "ep:0"
    proc = subprocess.run(
        [exe, "leases", "--pool", "nope"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == EXIT_FAILED
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
