"""``login-check`` and ``costs`` where a provider gives no answer, and the window ``costs`` reads.

The servers are real loopback sockets: a port nobody listens on (refused), a socket that
accepts and never answers (a read timeout), and a plain HTTP server asked for TLS. Each failed
check is one line that says what was called once, where, and why, with no secret in it.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading

import pytest
import yaml

from gpuhedge_celery.cli import EXIT_FAILED, EXIT_OK, main
from gpuhedge_celery.core.budget import utc_day
from gpuhedge_celery.providers.account import no_answer

pytestmark = pytest.mark.timeout(60)
KEY = "acct-secret-key-4242"


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def silent():
    """A loopback socket that accepts connections (the kernel does) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s.getsockname()[1]
    s.close()


@pytest.fixture
def plain_http():
    """A plain HTTP server: a client that asks it for TLS fails the handshake."""

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def http_block(base: str) -> dict:
    return {"base_url": base, "headers": {"authorization": "${ACCT_KEY}"},
            "submit": {"url": "/run", "body": {"input": "{request}"}, "job_id": "id"},
            "status": {"url": "/status/{job_id}", "state": "status"},
            "cancel": {"url": "/cancel/{job_id}"}}  # fmt: skip


def runpod_block(graphql_url: str) -> dict:
    return {"endpoint_id": "ep1", "api_key": "${ACCT_KEY}", "base_url": graphql_url,
            "graphql_url": graphql_url, "payload": "output.audio_base64",
            "timeouts": {"connect_s": 2, "read_s": 0.5}}  # fmt: skip


def cerebrium_block(url: str) -> dict:
    return {"project_id": "p-test", "app": "tts", "function": "predict",
            "api_key": "${ACCT_KEY}", "api_url": url, "rest_url": url,
            "payload": "result.audio_base64",
            "timeouts": {"connect_s": 2, "read_s": 0.5}}  # fmt: skip


@pytest.fixture
def cli(monkeypatch, tmp_path, redis_url, prefix):
    """``run(capsys, providers, *args) -> (exit code, stdout)``; no key may appear."""
    monkeypatch.setenv("ACCT_KEY", KEY)
    monkeypatch.delenv("GPUHEDGE_CONFIG", raising=False)
    path = tmp_path / "acct.yaml"

    def run(capsys, providers: dict, *args: str):
        path.write_text(yaml.safe_dump({"providers": providers, "budget": {"ceiling_usd": 10}}))
        code = main(["--redis-url", redis_url, "--prefix", prefix, "--config", str(path), *args])
        out = capsys.readouterr()
        assert KEY not in out.out + out.err, args
        return code, out.out

    return run


def test_login_check_says_why_a_provider_gave_no_answer(cli, capsys, silent, plain_http):
    refused = closed_port()
    providers = {
        "web": {"adapter": "http", "role": "primary",
                "http": http_block(f"http://127.0.0.1:{refused}/v2/ep1")},
        "rp-refused": {"adapter": "runpod", "role": "hedge",
                       "runpod": runpod_block(f"http://127.0.0.1:{refused}/graphql")},
        "rp-tls": {"adapter": "runpod", "role": "hedge",
                   "runpod": runpod_block(f"https://127.0.0.1:{plain_http}/graphql")},
        "rp-silent": {"adapter": "runpod", "role": "hedge",
                      "runpod": runpod_block(f"http://127.0.0.1:{silent}/graphql")},
        "cb": {"adapter": "cerebrium", "role": "fallback",
               "cerebrium": cerebrium_block(f"http://127.0.0.1:{refused}")},
    }  # fmt: skip
    code, out = cli(capsys, providers, "login-check", "--json")
    assert code == EXIT_FAILED
    rows = {r["provider"]: r for r in json.loads(out)}
    assert {r["status"] for r in rows.values()} == {"failed"}
    web = rows["web"]["detail"]
    assert web.startswith("status GET /status/{job_id} probe: no answer to 127.0.0.1:")
    assert web.count("GET") == 1 and "connection refused" in web, web
    assert "connection refused" in rows["rp-refused"]["detail"]
    assert rows["rp-refused"]["detail"].startswith(
        f"GraphQL POST /graphql: no answer to 127.0.0.1:{refused}"
    )
    assert "TLS handshake failed" in rows["rp-tls"]["detail"], rows["rp-tls"]
    assert "timed out waiting for the answer" in rows["rp-silent"]["detail"], rows["rp-silent"]
    cb = rows["cb"]["detail"]
    assert cb.startswith("GET /v2/projects/p-test/apps/p-test-tts: no answer") and "refused" in cb
    for row in rows.values():  # one line each, naming the exception class once at the end
        assert "\n" not in row["detail"] and row["detail"].endswith(")"), row
    # the table shows the same lines
    code, out = cli(capsys, providers, "login-check")
    assert code == EXIT_FAILED and len(out.strip().splitlines()) == 1 + len(providers)
    assert "GET GET" not in out


def test_the_reason_is_found_behind_any_wrapper():
    def wrapped(cause: BaseException) -> Exception:
        try:
            try:
                raise cause
            except BaseException as e:
                raise RuntimeError("call failed") from e
        except RuntimeError as outer:
            return outer

    unreachable = OSError(113, "No route to host")
    unreachable.errno = 113
    assert "host unreachable" in no_answer("GET /x", wrapped(unreachable))
    assert "host name not found" in no_answer("GET /x", wrapped(socket.gaierror(-2, "unknown")))
    assert no_answer("GET /x", wrapped(ValueError(f"bad {KEY}")), [KEY]) == (
        "GET /x: no answer: call failed (RuntimeError)"
    )
    line = no_answer("GET /x", RuntimeError(f"boom {KEY}\nsecond line"), [KEY])
    assert KEY not in line and "\n" not in line


def test_costs_reads_up_to_now_never_tomorrow(cli, capsys):
    before = utc_day()
    code, out = cli(capsys, {"s": {"adapter": "sim", "role": "primary"}}, "costs", "--json")
    after = utc_day()
    [row] = json.loads(out)
    assert code == EXIT_OK
    assert row["through"] in (before, after), row  # today, where the default window ends


def test_a_submit_that_never_connected_says_why():
    from gpuhedge_celery.config import parse_config
    from gpuhedge_celery.errors import SubmitError

    refused = f"http://127.0.0.1:{closed_port()}"
    cfg = parse_config({"providers": {
        "rp": {"adapter": "runpod", "runpod": {**runpod_block(f"{refused}/graphql"),
                                               "base_url": refused,
                                               "retries": {"attempts": 1}}},
        "cb": {"adapter": "cerebrium", "cerebrium": cerebrium_block(refused)},
    }, "budget": {"ceiling_usd": 1}}, source="acct.yaml")  # fmt: skip
    for name in ("rp", "cb"):
        provider = cfg.build(name, env={"ACCT_KEY": KEY})
        with pytest.raises(SubmitError) as caught:
            # a webhook address (Cerebrium answers by webhook only); nothing ever posts to it
            provider.submit({"text": "hello"}, context={"url": f"{refused}/hooks/r/a/t"})
        text = str(caught.value)
        assert "not sent: connection refused" in text and KEY not in text, text
