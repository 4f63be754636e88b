"""Hostile input, fuzzed with Hypothesis: YAML configs, policy names, requests, and the ``http``
adapter's provider responses from a loopback server (malformed, truncated, dripped slowly,
the wrong content type, enormous).

The only outcomes allowed: the value is accepted, or a one-line ConfigError / ProviderError
naming what was wrong (and never carrying the API key). Never another exception, never a
traceback in an error's text, never a call that outlives its timeouts. Every example count and
every call is bounded.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuhedge_celery.config import load_config
from gpuhedge_celery.core.jobs import JobHandle, JobState
from gpuhedge_celery.core.policies import parse_policy
from gpuhedge_celery.errors import ConfigError, ProviderError
from gpuhedge_celery.race.spec import build_spec, check_request
from gpuhedge_celery.store import codec
from tests.support.hostile_http import HostileHttpServer, Reply

API_KEY = "sk-fuzz-7f3a9c1e5b2d4f60"
FAST = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


def one_line(error: Exception) -> str:
    text = str(error)
    assert text and "\n" not in text and "Traceback" not in text, repr(text)
    return text


# --- YAML configs -------------------------------------------------------------------------

KEYS = ["providers", "policy", "slo", "timeouts", "budget", "validator", "time_scale", "role",
        "adapter", "sim", "http", "name", "params", "deadlines_s", "attempt_cap_s",
        "race_deadline_s", "timeout_s", "billed_rate_per_s", "base_url", "submit", "status",
        "cancel", "url", "job_id", "state", "max_response_bytes", "fast", "queue_s", "run_s",
        "p", "h", "primary", "hedge"]  # fmt: skip
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**12), 10**12), st.floats(allow_nan=True),
    st.text(max_size=20), st.sampled_from(["primary", "hedge", "sim", "http", "fixed", "wav"]),
)  # fmt: skip
yaml_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), inner, max_size=5),
    ),
    max_leaves=25,
)


@FAST
@given(doc=st.dictionaries(st.sampled_from(KEYS), yaml_values, max_size=6))
def test_any_yaml_config_loads_or_fails_with_one_line(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:
        cfg = load_config(path)
    except ConfigError as e:
        assert str(path) in one_line(e) or "c.yaml" in str(e)
        return
    build_spec(cfg) if cfg.providers else None


@FAST
@given(
    text=st.one_of(
        st.text(max_size=300), st.binary(max_size=300).map(lambda b: b.decode("latin-1"))
    )
)
def test_any_text_as_a_config_file_loads_or_fails_with_one_line(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "c.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    try:
        load_config(path)
    except ConfigError as e:
        one_line(e)


# --- policy names ---------------------------------------------------------------------------

policy_texts = st.one_of(
    st.text(max_size=60),
    st.builds(
        lambda kind, a, b, t: f"{kind}:{a}->{b}@{t}",
        st.sampled_from(["hedge", "cutover", "cascade", "single", "fixed", "x", ""]),
        st.text(max_size=8),
        st.text(max_size=8),
        st.one_of(st.text(max_size=10), st.floats().map(lambda f: f"{f}s")),
    ),  # fmt: skip
)


@FAST
@given(name=policy_texts)
def test_any_policy_name_parses_or_fails_with_one_line(name):
    try:
        policy = parse_policy(name)
    except ConfigError as e:
        one_line(e)
        return
    assert policy.providers()


# --- requests ---------------------------------------------------------------------------------

weird = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=30),
    st.binary(max_size=10), st.sets(st.integers(), max_size=3), st.complex_numbers(),
)  # fmt: skip
requests = st.recursive(
    weird,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), inner, max_size=4),
    ),
    max_leaves=30,
)


def nested(depth: int) -> dict:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return {"deep": value}


@FAST
@given(request=st.one_of(requests, st.integers(10, 200_000).map(nested)))
def test_any_request_is_accepted_and_storable_or_refused_with_one_line(request):
    try:
        checked = check_request(request)
    except ConfigError as e:
        assert "request" in one_line(e)
        return
    codec.dumps({"request": checked})  # what the race store writes must not fail later


# --- provider responses over HTTP -----------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
              st.text(max_size=20), st.sampled_from(["COMPLETED", "IN_QUEUE", "FAILED", "x"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.sampled_from(["id", "status", "output", "error",
                                                             "data"]), inner, max_size=4)),
    max_leaves=20,
)  # fmt: skip
LIMIT = 4096
READ_S = 0.5


@st.composite
def replies(draw):
    kind = draw(st.sampled_from(["json", "bytes", "truncated", "deep", "enormous", "drip"]))
    body = json.dumps(draw(json_values)).encode()
    declared = None
    drip, delay = 0, 0.0
    if kind == "bytes":
        body = draw(st.binary(max_size=200))
    elif kind == "truncated":
        declared = len(body) + draw(st.integers(1, 1000))
    elif kind == "deep":
        n = draw(st.integers(1000, 3000))  # within max_response_bytes, past json's recursion
        body = b"[" * n + b"]" * n
    elif kind == "enormous":
        body = b"[" + b"1," * draw(st.integers(LIMIT, 4 * LIMIT)) + b"1]"
        if draw(st.booleans()):
            declared = 10**12  # the header alone announces it
            body = body[:100]
    elif kind == "drip":
        body = b'{"id": "' + b"x" * 1000 + b'", "status": "COMPLETED"}'
        drip, delay = 4, 0.02  # about 5 s for the whole body: far past the 0.5 s read budget
    status = draw(st.sampled_from([200, 200, 201, 204, 301, 400, 404, 429, 500, 503]))
    ctype = draw(st.sampled_from(["application/json", "text/html", "text/plain", None]))
    return Reply(status, ctype, body, declared, drip, delay)


@pytest.fixture(scope="module")
def hostile():
    with HostileHttpServer() as server:
        yield server


def http_provider(tmp_path_factory, base_url: str):
    path = tmp_path_factory.mktemp("http") / "c.yaml"
    path.write_text(f"""
providers:
  fuzz:
    role: primary
    adapter: http
    http:
      base_url: "{base_url}"
      headers: {{authorization: "${{FUZZ_API_KEY}}"}}
      timeouts: {{connect_s: 1, read_s: {READ_S}}}
      max_response_bytes: {LIMIT}
      poll_interval_s: 0.05
      cancel_confirm_s: 0.3
      max_poll_errors: 2
      submit: {{method: POST, url: /run, body: {{input: "{{request}}"}}, job_id: id}}
      status: {{method: GET, url: "/status/{{job_id}}", state: status, payload: output}}
      cancel: {{method: POST, url: "/cancel/{{job_id}}"}}
budget: {{ceiling_usd: 1000}}
""")
    return load_config(path).build("fuzz", env={"FUZZ_API_KEY": API_KEY})


BOUND_S = 1 + READ_S + 1.0  # connect + the whole response + slack for a loaded machine


HTTP_FUZZ = settings(
    max_examples=40, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)  # fmt: skip


@HTTP_FUZZ
@given(reply=replies())
def test_any_provider_response_is_a_result_or_a_one_line_provider_error(
    hostile, tmp_path_factory, reply
):
    hostile.reply = reply
    provider = http_provider(tmp_path_factory, hostile.url)
    handle = JobHandle("fuzz", "job/1?x", time.time())
    refused = (reply.declared_length or len(reply.body)) > LIMIT or reply.drip_bytes > 0
    for call in ("submit", "status"):
        started = time.monotonic()
        try:
            out = provider.submit({"text": "hi"}) if call == "submit" else provider.status(handle)
        except ProviderError as e:
            assert API_KEY not in one_line(e)
        else:
            assert not refused, f"{call} read a body it should have refused: {reply}"
            assert isinstance(out, (JobHandle, JobState))
        assert time.monotonic() - started < BOUND_S, f"{call} took too long for {reply}"
    started = time.monotonic()
    receipt = provider.cancel(handle)  # reports what it saw; never raises
    assert API_KEY not in json.dumps(receipt.to_dict())
    result = provider.result(handle, cap_s=0.6)
    assert result.state in set(JobState)
    assert API_KEY not in json.dumps(result.to_dict(include_payload=False))
    assert time.monotonic() - started < 4 * BOUND_S
    provider.close()
