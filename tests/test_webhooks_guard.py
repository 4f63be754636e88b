"""The webhook receiver under slow and idle clients: the real command under a low descriptor
limit keeps answering /healthz through 1,000 connections that never finish their headers; in
process, a connection that owes its headers past the deadline is closed, and a body that stops
coming is answered 408."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gpuhedge_celery.webhooks import app as app_module
from gpuhedge_celery.webhooks import token as tokens
from gpuhedge_celery.webhooks.app import WebhookApp
from gpuhedge_celery.webhooks.guard import connection_cap, guarded_protocol
from gpuhedge_celery.webhooks.settings import WebhookSettings
from tests.support.redis_server import free_port

pytestmark = pytest.mark.timeout(120)
SECRET = "s3cret-0123456789abcdef"
SLOW_START = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"  # never the blank line that ends it


def slow_clients(port: int, n: int) -> list[socket.socket]:
    found = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(SLOW_START)
        found.append(s)
    return found


def healthz(port: int) -> int:
    return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


def test_the_receiver_answers_healthz_through_a_thousand_slow_connections(redis_url, tmp_path):
    port = free_port()
    env = {**os.environ, "GPUHEDGE_REDIS_URL": redis_url, "GPUHEDGE_WEBHOOK_SECRET": SECRET,
           "GPUHEDGE_WEBHOOK_URL": "https://hooks.example.com/h"}  # fmt: skip
    argv = [sys.executable, "-m", "gpuhedge_celery", "webhooks", "--host", "127.0.0.1",
            "--port", str(port)]  # fmt: skip
    server = subprocess.Popen(argv, env=env, cwd=tmp_path, preexec_fn=_low_fd_limit,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert healthz(port) == 200
                break
            except httpx.TransportError:
                assert server.poll() is None, server.stdout.read()
                assert time.monotonic() < deadline, "the receiver did not start"
                time.sleep(0.2)
        # 1,000 connections that never finish their headers, under a limit of 256 descriptors
        for _ in range(10):
            held += slow_clients(port, 100)
            assert healthz(port) == 200
        assert server.poll() is None
    finally:
        for s in held:
            s.close()
        server.terminate()
        server.wait(30)


@pytest.fixture
def guarded(monkeypatch):
    """The receiver app served in this process by uvicorn with a 0.5 s header deadline, a cap of
    20 connections and a 0.5 s body deadline."""
    import uvicorn

    monkeypatch.setattr(app_module, "BODY_TIMEOUT_S", 0.5)
    app = WebhookApp(WebhookSettings("http://x", SECRET, max_bytes=1000),
                     lambda race, attempt, body: (200, {"applied": "ok"}))  # fmt: skip
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            lifespan="off", http=guarded_protocol(20, 0.5))  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield port
    server.should_exit = True
    thread.join(10)


def test_a_connection_that_owes_its_headers_past_the_deadline_is_closed(guarded):
    (slow,) = slow_clients(guarded, 1)
    started = time.monotonic()
    slow.settimeout(5)
    assert slow.recv(1024) == b""  # closed by the server
    assert 0.4 < time.monotonic() - started < 3
    # a kept-alive connection owes the next request's headers too
    with socket.create_connection(("127.0.0.1", guarded), timeout=5) as kept:
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b'{"ok":true}'):
            answer += kept.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200")
        time.sleep(0.8)  # idle past the header deadline: the keep-alive timeout's to close
        kept.sendall(SLOW_START)  # a later request that never finishes its headers
        started = time.monotonic()
        assert kept.recv(1024) == b""
        assert 0.4 < time.monotonic() - started < 3


def test_past_the_cap_the_oldest_slow_connection_makes_room(guarded):
    held = slow_clients(guarded, 40)  # twice the cap
    try:
        assert healthz(guarded) == 200
        closed = 0
        for s in held[:20]:  # the oldest were closed to make room for the newer ones
            s.settimeout(0.2)
            try:
                closed += s.recv(1024) == b""
            except ConnectionResetError:  # closed with our request unread: a reset
                closed += 1
            except TimeoutError:
                pass
        assert closed >= 19
    finally:
        for s in held:
            s.close()


def test_a_body_that_stops_coming_is_answered_408(guarded):
    path = f"/hooks/r1/a1/{tokens.token(SECRET, 'r1', 'a1')}"
    with socket.create_connection(("127.0.0.1", guarded), timeout=5) as c:
        c.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n".encode())
        c.sendall(b'{"status": ')
        assert c.recv(4096).startswith(b"HTTP/1.1 408")


def test_the_cap_stays_under_the_descriptor_limit():
    assert connection_cap(256) == 96 and connection_cap(1_000_000) == 2048
    assert connection_cap(2**31) == 2048  # an unlimited soft limit


def test_idle_kept_alive_connections_make_room_too(guarded):
    idle = []
    try:
        for _ in range(25):  # more than the cap, each served once and then silent
            s = socket.create_connection(("127.0.0.1", guarded), timeout=5)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b'{"ok":true}'):
                chunk = s.recv(4096)
                if not chunk:
                    break
                answer += chunk
            idle.append(s)
        assert healthz(guarded) == 200  # an idle one was closed to let it in
    finally:
        for s in idle:
            s.close()
