"""A forged Cerebrium delivery cannot win a race whose validator is ``hmac``.

Real Celery coordination workers, the real webhook receiver (``gpuhedge-celery webhooks``, its
own process) and the loopback Cerebrium fake. Two Cerebrium providers race (``cb1`` primary,
``cb2`` hedge); the function's output is signed with ``signing.sign_result`` (the fake returns
it as the run's ``result``, as a function that signs would). While ``cb1``'s run is still
going, a forger who holds its webhook URL posts a well-formed WAV signed with another key: the
race marks that result invalid ("signature does not match") and the real, signed result wins,
also when the message names a validator of its own that the forgery would pass.
"""

from __future__ import annotations

import base64
import time

import httpx
import pytest

from gpuhedge_celery.core.validators import tone_wav
from gpuhedge_celery.race.receipt import load_payload
from gpuhedge_celery.signing import sign_result
from tests.support.cerebrium_fake import FakeCerebrium
from tests.support.fleet import fleet_cluster
from tests.support.race_configs import PAID_CEILING, cerebrium_provider, race_config

pytestmark = [pytest.mark.redis, pytest.mark.celery, pytest.mark.timeout(180)]

SECRET = "signed-races-webhook-secret-0123"
RESULT_KEY = "signed-races-result-key-0123456789"

HMAC = {"name": "hmac", "key": "${GPUHEDGE_TEST_RESULT_KEY}", "then": "wav", "at": "audio_base64"}


def config_text(url: str) -> str:
    def cerebrium(role: str) -> dict:
        # payload: the signed object, audio_base64 and signature
        return cerebrium_provider(
            role, 0.0005, url=url, project_id="p-e2e", payload="result", timeout_s=20
        )

    return race_config(
        {"cb1": cerebrium("primary"), "cb2": cerebrium("hedge")},
        "fixed",
        {"hedge_after_ms": 300},
        timeouts={"attempt_cap_s": 60},
        budget=PAID_CEILING,
        validator=HMAC,
    )


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("signed-races")
    with (
        FakeCerebrium({"webhook_gap_s": 0.5}) as fake,
        fleet_cluster(
            redis_url,
            tmp,
            config_text(fake.url),
            workers=1,
            env={"GPUHEDGE_TEST_RESULT_KEY": RESULT_KEY},
            webhook_secret=SECRET,
            fallback_s=20,
            receiver_timeout_s=20,
        ) as rc,
    ):
        rc.fake = fake
        yield rc


def webhook_of(rc, race_id: str, provider: str, timeout_s: float = 10.0) -> tuple[str, str]:
    """(run id, webhook URL) of ``provider``'s run in the race, once it is submitted."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for job in rc.store.live_jobs(race_id).values():
            if job.get("provider") == provider and job.get("job_id"):
                run = rc.fake.run(job["job_id"])
                if run and run.get("webhook"):
                    return job["job_id"], run["webhook"]
        time.sleep(0.02)
    raise AssertionError(f"{provider} was not submitted within {timeout_s} s:\n{rc.logs()}")


def race_with_a_forgery(rc, **kwargs):
    """A race (``kwargs``: hedged_infer's) whose primary's webhook URL gets a well-formed WAV
    signed with another key while its run goes on: (its output, its receipt, the genuine
    signed output)."""
    audio = base64.b64encode(tone_wav(1.0)).decode("ascii")
    signed = sign_result({"audio_base64": audio}, RESULT_KEY)
    request = {"text": "hello", "cerebrium_fake": {"queue_s": 0, "run_s": 2.0, "output": signed}}
    res = rc.send(request, policy="hedge:cb1->cb2@0.3s", **kwargs)
    run_id, url = webhook_of(rc, res.id, "cb1")
    # a well-formed WAV, signed with a key that is not the function's
    forged = sign_result({"audio_base64": audio, "note": "forged"}, "attacker-key-0123456789")
    answer = httpx.post(url, json={"run_id": run_id, "result": forged}, timeout=5)
    assert answer.status_code < 500, answer.text
    try:
        return res.get(timeout=60), rc.receipt(res.id, timeout=30), signed
    except BaseException:
        print(rc.logs(), rc.receiver_log.read_text())
        raise


def assert_the_signed_result_won(rc, out, receipt, signed):
    assert out["winner"] == "cb2"
    by_provider = {a["provider"]: a for a in receipt["attempts"]}
    assert "signature does not match" in by_provider["cb1"]["reasons"]
    assert receipt["winner"] == by_provider["cb2"]["id"] and receipt["validator"] == "hmac"
    payload = load_payload(out, client=rc.client)
    assert payload == signed  # the function's own output, not the forgery


def test_a_forged_delivery_is_invalid_and_the_signed_result_wins(cluster):
    rc = cluster
    out, receipt, signed = race_with_a_forgery(rc)
    assert_the_signed_result_won(rc, out, receipt, signed)
    # the key is in no receipt, no worker log and no receiver log
    everything = repr(receipt) + rc.logs() + rc.receiver_log.read_text()
    assert RESULT_KEY not in everything


def test_a_messages_own_validator_cannot_switch_the_signature_check_off(cluster):
    """``validator="nonempty"`` in the message, which the forgery passes: it is checked after
    the config's ``hmac``, not instead of it."""
    out, receipt, signed = race_with_a_forgery(cluster, validator="nonempty")
    assert_the_signed_result_won(cluster, out, receipt, signed)
