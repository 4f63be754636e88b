"""No secret anywhere, with every process logging at DEBUG: races run on a real worker
(``celery worker -l DEBUG``) through three adapters, each with credentials of its own:

* an ``http`` provider whose API key is a header and whose URL carries a ``${VAR}`` token, on a
  loopback server that demands the key and puts it in its error replies (as some real APIs
  echo headers), so a failure path that copied a provider's error text verbatim would leak it;
* the ``runpod`` adapter against the RunPod fake, and the ``cerebrium`` adapter against the
  Cerebrium fake, both with webhooks on: the receiver (``gpuhedge-celery --log-level DEBUG
  webhooks``) applies their deliveries, each attempt's URL holding its own token;
* a Redis that wants a password (in every process's Redis URL).

Every CLI command then runs at ``--log-level DEBUG``. Receipts, records, every Redis value
under the test's prefixes, the whole worker and receiver logs, task events, CLI output and
exported files are searched for each API key, the URL token, the webhook secret, every
attempt's webhook token and the Redis password: 0 occurrences.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import pytest

from tests.support.cerebrium_fake import KEY as CB_KEY
from tests.support.cerebrium_fake import FakeCerebrium
from tests.support.faults import RestartableRedis, start_fault_cluster
from tests.support.fleet import FAKE_KEYS, webhook_env
from tests.support.http_provider_server import HttpProviderServer, Knobs
from tests.support.race_configs import (
    FAKE_TIMEOUTS,
    PAID_CEILING,
    cerebrium_provider,
    race_config,
    runpod_provider,
)
from tests.support.receiver import start_receiver, stop_receiver
from tests.support.runpod_fake import KEY as RP_KEY
from tests.support.runpod_fake import FakeRunpod
from tests.support.waiting import wait_until_subscribed
from tests.support.webhook_server import free_port

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.timeout(300)]

SECRET = "sk-live-9Q4z7XgW2pLmT8vRcJ5n"  # distinctive: any hit is this test's key
URL_TOKEN = "urltok-Hq82mZp0aLx7Vd4k"  # the http provider's ${VAR} in its URL
HOOK_SECRET = "whsec-4Yt9bQ2nR7cW1xZp"  # GPUHEDGE_WEBHOOK_SECRET
REDIS_PASSWORD = "redispw-K3v8Lq1sNd6Tf0Bj"
REQUEST_TEXT = "caller-says-Mw4pX9rTq2"  # a caller's request: its size in logs, never its text


def config_text(base: str, runpod: str, cerebrium: str) -> str:
    http = {
        "base_url": f"{base}/v2/${{HTTP_TEST_URL_TOKEN}}",
        "headers": {"authorization": "${GPUHEDGE_TEST_SECRET_KEY}"},
        "timeouts": FAKE_TIMEOUTS,
        "poll_interval_s": 0.05,
        "cancel_confirm_s": 1,
        "submit": {"method": "POST", "url": "/run", "body": {"input": "{request}"}, "job_id": "id"},
        "status": {
            "method": "GET",
            "url": "/status/{job_id}",
            "state": "status",
            "payload": "output.audio_base64",
            "error": "error",
        },
        "cancel": {"method": "POST", "url": "/cancel/{job_id}"},
    }
    return race_config(
        {
            "rp": {"role": "primary", "adapter": "http", "billed_rate_per_s": 0.0003, "http": http},
            "rpd": runpod_provider("hedge", 0.0003, endpoint_id="sec-rp", base_url=runpod),
            "cb": cerebrium_provider("fallback", 0.0005, url=cerebrium, project_id="p-sec"),
        },
        "single",
        # a race whose status replies stay malformed fails at its cap (its error text is
        # searched too) instead of outliving the caller's wait
        timeouts={"attempt_cap_s": 8},
        budget=PAID_CEILING,
    )


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


def test_no_credential_in_any_output_with_every_process_at_debug(tmp_path):
    from gpuhedge_celery.webhooks.token import token

    knobs = Knobs(api_key=SECRET)
    redis = RestartableRedis(password=REDIS_PASSWORD).start()
    runpod = FakeRunpod({"api_key": RP_KEY, "webhook_gap_s": 0.2})
    cerebrium = FakeCerebrium({"webhook_gap_s": 0.2})
    server = HttpProviderServer(knobs).__enter__()
    cluster = receiver = None
    credentials = {
        "http key": SECRET,
        "http URL token": URL_TOKEN,
        "RunPod key": RP_KEY,
        "Cerebrium key": CB_KEY,
        "webhook secret": HOOK_SECRET,
        "Redis password": REDIS_PASSWORD,
    }
    try:
        config = tmp_path / "secret.yaml"
        config.write_text(config_text(server.url, runpod.base_url, cerebrium.url))
        port = free_port()
        cluster = start_fault_cluster(
            redis.url,
            tmp_path,
            deadline_s=20.0,
            coordinators=0,
            beat=False,
            GPUHEDGE_CONFIG=str(config),
            GPUHEDGE_TEST_SECRET_KEY=SECRET,
            HTTP_TEST_URL_TOKEN=URL_TOKEN,
            **FAKE_KEYS,
            **webhook_env(port, HOOK_SECRET, 20),
        )
        cluster.loglevel = "DEBUG"
        cli = [sys.executable, "-m", "gpuhedge_celery", "--log-level", "DEBUG"]
        receiver_log = tmp_path / "receiver.log"
        cluster.wait_ready(cluster.start_coordinator(wait=False))
        receiver = start_receiver(cluster.env, port, tmp_path, cli=cli)
        events = EventLog(cluster.app)
        wait_until_subscribed(cluster.app, events.events)  # events sent before are lost
        send = cluster.app.send_task
        won = send("gpuhedge.hedged_infer", ({"text": REQUEST_TEXT},), queue="gpuhedge.coord")
        assert won.get(timeout=60)["winner"] == "rp"
        sent = [won]
        outcomes = []
        for knob in ("submit_errors", "status_errors", "malformed"):
            # a few of each: every error path is taken (each status error is polled again
            # after a backoff, so 50 took 50 s)
            setattr(knobs, knob, {"status"} if knob == "malformed" else 5)
            r = send("gpuhedge.hedged_infer", ({"text": REQUEST_TEXT},), queue="gpuhedge.coord")
            sent.append(r)
            outcomes.append(outcome(r))
            setattr(knobs, knob, set() if knob == "malformed" else 0)
        # RunPod hedged by Cerebrium, both through webhooks: Cerebrium wins, RunPod's job is
        # cancelled; then a Cerebrium run that fails
        fast_cb = {
            "text": REQUEST_TEXT,
            "runpod_fake": {"sec-rp": {"queue_s": 0, "run_s": 4}},
            "cerebrium_fake": {"queue_s": 0, "run_s": 0.2},
        }
        failing = {
            "text": REQUEST_TEXT,
            "runpod_fake": {"sec-rp": {"queue_s": 0, "run_s": 0.5, "outcome": "FAILED"}},
            "cerebrium_fake": {"queue_s": 0, "run_s": 0.2, "outcome": "FAILED"},
        }
        for request in (fast_cb, failing):
            r = send(
                "gpuhedge.hedged_infer",
                (request,),
                {"policy": "hedge:rpd->cb@0.3s"},
                queue="gpuhedge.coord",
            )
            sent.append(r)
            outcomes.append(outcome(r))
        env = dict(cluster.env)
        out_dir = tmp_path / "out"
        out_dir.mkdir()
        records = out_dir / "records.jsonl"
        runs = [
            *[[*cli, "receipt", r.id] for r in sent],
            [*cli, "receipt", won.id, "--json"],
            [*cli, "records", "export"],
            [*cli, "config", "check", str(config)],
            [*cli, "config", "show", str(config)],
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
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        outputs.append(report.stdout + report.stderr)
        captured = events.stop()
        receipts = [cluster_receipt(cluster, r.id) for r in sent]
        hooked = [a for rc in receipts for a in rc["attempts"] if a["provider"] in ("rpd", "cb")]
        for a in hooked:  # each webhook attempt's own URL token is a credential too
            rid = next(rc["race_id"] for rc in receipts if a in rc["attempts"])
            credentials[f"webhook token of {rid}/{a['id']}"] = token(HOOK_SECRET, rid, a["id"])
        places = {
            "redis": dump_redis(cluster),
            "worker logs": "\n".join(w.log() for w in cluster.workers),  # whole, not tails
            "receiver log": receiver_log.read_text(errors="replace"),
            "task events": json.dumps(captured, default=str),
            "cli output": "\n".join(outputs),
            "exported files": "\n".join(
                p.read_text(errors="replace") for p in out_dir.rglob("*") if p.is_file()
            ),
            "caller errors": "\n".join(outcomes),
        }
        found = {
            f"{what} in {where}": text.count(value)
            for what, value in credentials.items()
            for where, text in places.items()
            if value in text
        }
        assert not found, found
        logs = places["worker logs"] + places["receiver log"] + places["cli output"]
        for where in ("worker logs", "receiver log", "task events"):
            assert REQUEST_TEXT not in places[where], f"a caller's request in the {where}"
        hook_url = re.compile(r"(/|%2F)[0-9a-f]{32}(\b|$)")  # any attempt's token in a URL
        assert not hook_url.search(logs), hook_url.search(logs)
        # the searches saw what they were meant to see
        assert "DEBUG/MainProcess" in places["worker logs"], "the worker did not log at DEBUG"
        assert " DEBUG " in places["cli output"], "no CLI command logged at DEBUG"
        assert won.id in places["redis"] and won.id in places["cli output"]
        assert any(e.get("type") == "task-won" for e in captured), "no task events seen"
        assert records.read_text().strip(), "records export wrote nothing"
        assert any(URL_TOKEN in r.raw_path for r in server.requests), "URL token never used"
        winners = [winner_provider(rc) for rc in receipts]
        assert winners[-2:] == ["cb", None], winners  # a webhook won, then both failed
        assert len(hooked) >= 4 and any(o != "won" for o in outcomes)
        print(
            json.dumps(
                {
                    "fault": "secrets",
                    "credentials": len(credentials),
                    "places": list(places),
                    "events": len(captured),
                    "log_bytes": len(logs),
                }
            )
        )
    finally:
        stop_receiver(receiver)
        if cluster is not None:
            cluster.close()
        server.__exit__(None, None, None)
        runpod.stop()
        cerebrium.stop()
        redis.close()


def outcome(result) -> str:
    """``won``, or the caller's error with its receipt (whose text is searched too)."""
    try:
        result.get(timeout=60)
        return "won"
    except Exception as e:  # RaceFailed
        return f"{type(e).__name__}: {e} {getattr(e, 'receipt', '')}"


def winner_provider(receipt: dict) -> str | None:
    won = [a["provider"] for a in receipt["attempts"] if a["id"] == receipt["winner"]]
    return won[0] if won else None


def cluster_receipt(cluster, race_id: str) -> dict:
    from gpuhedge_celery.store.races import RaceStore
    from tests.support.faults import wait_until

    store = RaceStore(cluster.client, cluster.prefix)
    return wait_until(lambda: store.receipt(race_id), 30, what=f"the receipt of {race_id}")


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
