"""The native ``runpod`` adapter's answers, fuzzed with Hypothesis from a raw loopback server:
malformed JSON, random bytes, truncated bodies, nesting past any parser's depth, enormous
bodies (or a Content-Length announcing one), a slow drip, every content type, statuses from
200 to 503.

Allowed outcomes: ``submit`` returns a handle or raises a one-line ProviderError, which says
"submit outcome unknown" whenever an answer began but could not be read (the race flags a
possible leak); ``status`` returns a state or raises a one-line ProviderError; ``cancel`` and
``result`` never raise and end in an explicit state. No call outlives its timeouts and
retries, no body over ``max_response_bytes`` is read, and the API key appears nowhere.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings

from gpuhedge_celery.core.jobs import JobHandle, JobState
from gpuhedge_celery.core.receipts import SUBMIT_OUTCOME_UNKNOWN
from gpuhedge_celery.errors import ProviderError, RateLimited
from tests.fuzz.fuzz_hostile_input import LIMIT, READ_S, one_line, replies
from tests.support.hostile_http import HostileHttpServer, Reply
from tests.support.runpod_fake import runpod_provider

API_KEY = "rp-fuzz-5d1e9a7c3b2f4e80"
ATTEMPTS = 1  # a status call is sent at most twice
# connect + the whole response, per send, plus the backoff and slack for a loaded machine
BOUND_S = (ATTEMPTS + 1) * (1 + READ_S) + 1.0

FUZZ = settings(
    max_examples=40, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)  # fmt: skip


@pytest.fixture(scope="module")
def hostile():
    with HostileHttpServer() as server:
        yield server


def provider(url: str, max_block_s: float = 0.25):
    """``max_block_s``: a status retry due later than that is handed back as a deferral."""
    return runpod_provider(
        SimpleNamespace(base_url=url, url=url), key=API_KEY,
        timeouts={"connect_s": 1, "read_s": READ_S}, max_response_bytes=LIMIT,
        cancel_confirm_s=0.3, cancel_poll_s=0.05,
        retries={"attempts": ATTEMPTS, "backoff_s": 0.02, "max_backoff_s": 0.05,
                 "max_block_s": max_block_s},
    )  # fmt: skip


def refused(reply: Reply) -> bool:
    """Whether the adapter must refuse the body unread (too big, or too slow to arrive)."""
    return (reply.declared_length or len(reply.body)) > LIMIT or reply.drip_bytes > 0


@FUZZ
@given(reply=replies())
def test_any_runpod_answer_is_a_state_or_a_one_line_provider_error(hostile, reply):
    hostile.reply = reply
    p = provider(hostile.url)
    try:
        started = time.monotonic()
        try:
            out = p.submit({"text": "hi"})
        except ProviderError as e:
            text = one_line(e)
            assert API_KEY not in text
            if refused(reply) or 200 <= reply.status < 300:  # an answer began: accepted?
                assert SUBMIT_OUTCOME_UNKNOWN in text, (text, reply)
        else:
            assert not refused(reply), f"submit read a body it should have refused: {reply}"
            assert 200 <= reply.status < 400 and isinstance(out, JobHandle)
        assert time.monotonic() - started < 1 + READ_S + 1.0, f"submit took too long: {reply}"

        handle = JobHandle("rp", "job/1?x", time.time(), extra={"endpoint": "ep1"})
        started = time.monotonic()
        try:
            state = p.status(handle)
        except ProviderError as e:
            assert API_KEY not in one_line(e)
        else:
            assert not refused(reply), f"status read a body it should have refused: {reply}"
            assert isinstance(state, JobState)
        assert time.monotonic() - started < BOUND_S, f"status took too long: {reply}"

        started = time.monotonic()
        receipt = p.cancel(handle)  # reports what it saw; never raises
        assert API_KEY not in json.dumps(receipt.to_dict())
        result = p.result(handle, cap_s=0.6)
        assert result.state in set(JobState)
        assert API_KEY not in json.dumps(result.to_dict(include_payload=False))
        assert time.monotonic() - started < 6 * BOUND_S
    finally:
        p.close()


def test_an_enormous_answer_is_refused_by_its_header_before_any_of_it_is_read(hostile):
    hostile.reply = Reply(200, "application/json", b'{"id": "x"', declared_length=10**12)
    p = provider(hostile.url)
    with pytest.raises(ProviderError) as caught:
        p.submit({"text": "hi"})
    text = one_line(caught.value)
    assert SUBMIT_OUTCOME_UNKNOWN in text and "max_response_bytes" in text
    p.close()


def test_a_dripped_status_answer_is_cut_off_at_read_s_and_retried(hostile):
    body = b'{"id": "j", "status": "' + b"x" * 400 + b'"}'
    hostile.reply = Reply(200, "application/json", body, drip_bytes=4, drip_delay_s=0.02)
    before = hostile.requests
    p = provider(hostile.url, max_block_s=3.0)
    started = time.monotonic()
    with pytest.raises(ProviderError) as caught:
        p.status(JobHandle("rp", "j", time.time(), extra={"endpoint": "ep1"}))
    took = time.monotonic() - started
    assert "too slow" in one_line(caught.value)
    assert hostile.requests - before == ATTEMPTS + 1  # too slow is retried, like a timeout
    assert (ATTEMPTS + 1) * READ_S <= took < BOUND_S, took
    p.close()
    # where the caller may not block that long (a watch poll), the retry becomes a deferral
    p = provider(hostile.url)
    with pytest.raises(RateLimited) as caught:
        p.status(JobHandle("rp", "j", time.time(), extra={"endpoint": "ep1"}))
    assert "too slow" in one_line(caught.value) and caught.value.retry_at > time.time() - 1
    p.close()
