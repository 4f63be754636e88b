"""No secret anywhere: a distinctive API key is set in the environment, races that win and races
that fail run on a real worker against a loopback provider that demands that key, every CLI
command runs, and then receipts, records, every Redis value under the test's prefixes, worker
logs, task events, CLI output and exported files are searched for it: 0 occurrences.

The provider puts the key in its error replies (as some real APIs echo headers), so a failure
path that copied a provider's error text verbatim would leak it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.support.faults import start_fault_cluster
from tests.support.http_provider_server import HttpProviderServer, Knobs

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.timeout(240)]

SECRET = "sk-live-9Q4z7XgW2pLmT8vRcJ5n"  # distinctive: any hit is this test's key

HTTP_CONFIG = """
providers:
  rp:
    role: primary
    adapter: http
    billed_rate_per_s: 0.0003
    http:
      base_url: "{base}"
      headers: {{authorization: "${{GPUHEDGE_TEST_SECRET_KEY}}"}}
      timeouts: {{connect_s: 2, read_s: 5}}
      poll_interval_s: 0.05
      cancel_confirm_s: 1
      submit: {{method: POST, url: /run, body: {{input: "{{request}}"}}, job_id: id}}
      status: {{method: GET, url: "/status/{{job_id}}", state: status,
               payload: output.audio_base64, error: error}}
      cancel: {{method: POST, url: "/cancel/{{job_id}}"}}
policy:
  name: single
# a race whose status replies stay malformed fails at its cap (its error text is searched too)
# instead of outliving the caller's wait
timeouts: {{attempt_cap_s: 8}}
budget: {{ceiling_usd: 1000}}   # paid adapters need a ceiling (docs/costs.md)
validator: wav
"""


class EventLog:
    """Every task event the broker carries while the test runs (what Flower would see)."""

    def __init__(self, app):
        self.events: list[dict] = []
        self._thread = threading.Thread(target=self._run, args=(app,), daemon=True)
        self._thread.start()

    def _run(self, app) -> None:
        with app.connection_for_read() as conn:
            self.receiver = app.events.Receiver(conn, handlers={"*": self.events.append})
            try:
                self.receiver.capture(limit=None, timeout=None, wakeup=False)
            except Exception:  # the connection closes under it at the end of the test
                pass

    def stop(self) -> list[dict]:
        receiver = getattr(self, "receiver", None)
        if receiver is not None:
            receiver.should_stop = True
        self._thread.join(5)
        return list(self.events)


def test_no_api_key_in_receipts_records_redis_logs_events_or_cli_output(redis_url, tmp_path):
    knobs = Knobs(api_key=SECRET)
    with HttpProviderServer(knobs) as server:
        config = tmp_path / "secret.yaml"
        config.write_text(HTTP_CONFIG.format(base=server.base_url("ep1")))
        cluster = start_fault_cluster(
            redis_url, tmp_path, deadline_s=5.0, coordinators=0, beat=False,
            GPUHEDGE_CONFIG=str(config), GPUHEDGE_TEST_SECRET_KEY=SECRET,
        )  # fmt: skip
        os.environ["GPUHEDGE_TEST_SECRET_KEY"] = SECRET  # as the CLI's shell would have it
        try:
            cluster.wait_ready(cluster.start_coordinator(wait=False))
            events = EventLog(cluster.app)
            time.sleep(0.5)
            send = cluster.app.send_task
            won = send("gpuhedge.hedged_infer", ({"text": "hi"},), queue="gpuhedge.coord")
            assert won.get(timeout=60)["winner"] == "rp"
            outcomes = []
            for knob in ("submit_errors", "status_errors", "malformed"):
                # a few of each: every error path is taken (each status error is polled again
                # after a backoff, so 50 took 50 s)
                setattr(knobs, knob, {"status"} if knob == "malformed" else 5)
                r = send("gpuhedge.hedged_infer", ({"text": "x"},), queue="gpuhedge.coord")
                try:
                    r.get(timeout=60)
                    outcomes.append("won")
                except Exception as e:  # RaceFailed: its text and receipt are searched too
                    outcomes.append(f"{type(e).__name__}: {e} {getattr(e, 'receipt', '')}")
                setattr(knobs, knob, set() if knob == "malformed" else 0)
            env = {**cluster.env, "PYTHONPATH": cluster.env["PYTHONPATH"]}
            out_dir = tmp_path / "out"
            out_dir.mkdir()
            records = out_dir / "records.jsonl"
            cli = [sys.executable, "-m", "gpuhedge_celery"]
            runs = [
                [*cli, "receipt", won.id],
                [*cli, "receipt", won.id, "--json"],
                [*cli, "records", "export"],
                [*cli, "config", "check", str(config)],
                [*cli, "leases"],
                [*cli, "watch", "--once"],
            ]
            outputs = []
            for argv in runs:
                done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
                outputs.append(f"$ {' '.join(argv)}\n{done.stdout}\n{done.stderr}")
                if argv[-1] == "export":
                    records.write_text(done.stdout)
            report = subprocess.run(
                [*cli, "report", str(records)],
                env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            outputs.append(report.stdout + report.stderr)
            captured = events.stop()
            places = {
                "redis": dump_redis(cluster),
                "worker logs": cluster.logs(),
                "task events": json.dumps(captured, default=str),
                "cli output": "\n".join(outputs),
                "exported files": "\n".join(
                    p.read_text(errors="replace") for p in out_dir.rglob("*") if p.is_file()
                ),
                "caller errors": "\n".join(outcomes),
            }
            found = {where: text.count(SECRET) for where, text in places.items()}
            assert sum(found.values()) == 0, found
            # the searches saw what they were meant to see
            assert won.id in places["redis"] and won.id in places["cli output"]
            assert any(e.get("type") == "task-won" for e in captured), "no task events seen"
            assert records.read_text().strip(), "records export wrote nothing"
            assert knobs.api_key in SECRET and any(o != "won" for o in outcomes)
            print(json.dumps({"fault": "secrets", "places": found, "events": len(captured)}))
        finally:
            os.environ.pop("GPUHEDGE_TEST_SECRET_KEY", None)
            cluster.close()


def dump_redis(cluster) -> str:
    """Every value under the test's key prefixes (race store and broker), as text."""
    client = cluster.client
    parts = []
    for key in client.scan_iter(f"{cluster.prefix}*", count=1000):
        kind = client.type(key)
        if kind == "string":
            parts.append(str(client.get(key)))
        elif kind == "hash":
            parts.append(json.dumps(client.hgetall(key)))
        elif kind == "list":
            parts.append(json.dumps(client.lrange(key, 0, -1)))
        elif kind == "zset":
            parts.append(json.dumps(client.zrange(key, 0, -1)))
        elif kind == "set":
            parts.append(json.dumps(sorted(client.smembers(key))))
        elif kind == "stream":
            parts.append(json.dumps(client.xrange(key), default=str))
        parts.append(key)
    return "\n".join(parts)
