"""Celery message signing (``task_serializer = "auth"``) on real workers: a fleet that sets
``GPUHEDGE_SECURITY_*`` (a self-signed certificate made in the test) races as before, and a
task message that is not signed, sent to the same queue, is refused by the worker and never run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from gpuhedge_celery.errors import ConfigError
from gpuhedge_celery.tasks.app import TASK_POOLED_INFER
from gpuhedge_celery.tasks.message_signing import Signing
from tests.support.certs import self_signed
from tests.support.faults import (
    HEDGED_REQUEST,
    QUICK_REQUEST,
    send_race,
    start_fault_cluster,
    wait_until,
)

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.timeout(180)]

FORGED_TEXT = "unsigned-request-Vb8qLz3x"  # in the refused message's body
# sends one hedged_infer (argv: request JSON, task id) with this process's signing settings
SEND_ONE = """
import json, sys
from gpuhedge_celery.tasks.app import create_app
from gpuhedge_celery.tasks.config import GlueConfig
app = create_app(GlueConfig.from_env())
app.send_task("gpuhedge.hedged_infer", (json.loads(sys.argv[1]),), queue="gpuhedge.coord",
              task_id=sys.argv[2])
"""


@pytest.fixture
def kombu_registry():
    """``setup_security`` changes kombu's serializer registry for the whole process: put back
    the default serializer and the decoders it turned off once the test is done."""
    from kombu.serialization import registry

    saved = (
        set(registry._disabled_content_types),
        registry._default_encode,
        registry._default_content_type,
        registry._default_content_encoding,
    )
    yield registry
    disabled, registry._default_encode, registry._default_content_type, encoding = saved
    registry._default_content_encoding = encoding
    registry._disabled_content_types = disabled


def signing_env(tmp_path) -> dict[str, str]:
    """A fleet key and certificate, and a store that trusts only that certificate."""
    key, cert = self_signed(tmp_path / "signing", "fleet")
    store = tmp_path / "signing" / "trusted"
    store.mkdir()
    (store / "fleet.pem").write_bytes(cert.read_bytes())
    return {
        "GPUHEDGE_SECURITY_KEY": str(key),
        "GPUHEDGE_SECURITY_CERTIFICATE": str(cert),
        "GPUHEDGE_SECURITY_CERT_STORE": str(store),
    }


def test_signing_is_all_three_paths_or_none(tmp_path):
    env = signing_env(tmp_path)
    assert Signing.from_env({}) is None
    signing = Signing.from_env(env)
    assert signing is not None and signing.celery_conf()["task_serializer"] == "auth"
    for missing in env:
        with pytest.raises(ConfigError) as e:
            Signing.from_env({k: v for k, v in env.items() if k != missing})
        assert e.value.key == missing
    with pytest.raises(ConfigError) as e:
        Signing.from_env({**env, "GPUHEDGE_SECURITY_KEY": str(tmp_path / "nope.key")})
    assert e.value.key == "GPUHEDGE_SECURITY_KEY" and "nope.key" in str(e.value)


def test_a_signed_fleet_races_and_refuses_an_unsigned_task(
    redis_url, tmp_path, kombu_registry, broker, request
):
    from gpuhedge_celery.store.race_keys import race_keys_pattern
    from gpuhedge_celery.store.races import RaceStore
    from gpuhedge_celery.tasks.app import create_app
    from tests.support.fixtures_celery import broker_url_for

    env = signing_env(tmp_path)
    # a GPU worker (prefork) and beat too: pooled jobs, the reconcile pass and its remote
    # control calls to the GPU worker all travel signed
    cluster = start_fault_cluster(
        redis_url, tmp_path, deadline_s=20.0, coordinators=1, gpus=1,
        broker_url=broker_url_for(broker, request), **env,
    )  # fmt: skip
    try:
        signed = create_app(cluster.config, signing=Signing.from_env(cluster.env))
        assert signed.conf.task_serializer == "auth" and signed.conf.accept_content == ["auth"]
        cluster.app = signed
        won = send_race(cluster, HEDGED_REQUEST).get(timeout=60)
        assert won["winner"], won
        job = signed.send_task(TASK_POOLED_INFER, ({"id": "job0", "duration_s": 0.1},))
        assert job.get(timeout=60)["output"]["id"] == "job0"
        # the CLI's own app signs too (it builds one from the same environment)
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpuhedge_celery",
                "race",
                json.dumps(QUICK_REQUEST),
                "--go",
                "--json",
                "--timeout",
                "60",
            ],
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert cli.returncode == 0 and json.loads(cli.stdout)["winner"], cli.stdout + cli.stderr
        # the same task, sent as plain JSON by an app that does not sign
        unsigned = create_app(cluster.config)
        assert unsigned.conf.task_serializer == "json"
        forged_id = f"forged-{uuid.uuid4().hex}"
        forged = {**QUICK_REQUEST, "text": FORGED_TEXT}
        unsigned.send_task(
            "gpuhedge.hedged_infer", (forged,), queue="gpuhedge.coord", task_id=forged_id
        )
        worker = cluster.workers[0]
        refused = "Refusing to deserialize untrusted content of type json"
        wait_until(lambda: refused in worker.log(), 30, what="the worker to refuse the message")
        # signed, but by a key whose certificate the fleet does not trust (another process:
        # the auth serializer is one per process)
        rogue_key, rogue_cert = self_signed(tmp_path / "rogue", "rogue")
        rogue_id = f"rogue-{uuid.uuid4().hex}"
        rogue_env = {
            **cluster.env,
            "GPUHEDGE_SECURITY_KEY": str(rogue_key),
            "GPUHEDGE_SECURITY_CERTIFICATE": str(rogue_cert),
            "GPUHEDGE_SECURITY_CERT_STORE": str(rogue_cert),
        }
        sent = subprocess.run(
            [sys.executable, "-c", SEND_ONE, json.dumps(forged), rogue_id],
            env=rogue_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sent.returncode == 0, sent.stderr
        wait_until(
            lambda: "Can't decode message body" in worker.log(),
            30,
            what="the worker to refuse the message of an untrusted signer",
        )
        # a signed race after them still runs: the worker stayed up and took it
        assert send_race(cluster, QUICK_REQUEST).get(timeout=30)["winner"]
        time.sleep(1.0)
        store = RaceStore(cluster.client, cluster.prefix)
        for refused_id in (forged_id, rogue_id):
            assert store.receipt(refused_id) is None, f"{refused_id} ran"
            assert not list(cluster.client.scan_iter(race_keys_pattern(cluster.prefix, refused_id)))
            assert signed.AsyncResult(refused_id).state == "PENDING"
        assert worker.alive() and "Unrecoverable error" not in worker.log()
        # each refusal names the message's size, not its body (a caller's request)
        assert FORGED_TEXT not in worker.log()
        assert worker.log().count("bytes, not shown>") >= 2, worker.log()[-3000:]
        logs = "\n".join(w.log() for w in cluster.workers)
        assert logs.count("Received invalid task message") == 1, cluster.logs()  # ours only
        assert logs.count("Can't decode message body") == 1, cluster.logs()
        assert "gpuhedge.reconcile" in logs  # beat's signed passes were taken and run
    finally:
        cluster.close()
