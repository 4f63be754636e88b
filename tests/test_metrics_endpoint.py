"""A worker's metrics endpoint under idle and slow clients: loopback by default, a bounded
number of threads however many sockets arrive, and a silent client dropped after its timeout."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest

from gpuhedge_celery.metrics import exposition
from tests.support.redis_server import free_port


@pytest.fixture
def endpoint(monkeypatch):
    monkeypatch.setattr(exposition._QuietHandler, "timeout", 0.5)  # noqa: SLF001
    found = exposition.start_worker_endpoint({exposition.PORT_VAR: str(free_port())}, forks=False)
    yield found
    found.close()


def scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return answer.read()


def test_it_listens_on_loopback_unless_told_otherwise(endpoint):
    assert endpoint.server.server_address[0] == "127.0.0.1"
    assert b"gpuhedge_" in scrape(endpoint.port)


def test_a_hundred_silent_sockets_hold_a_few_threads_and_are_dropped(endpoint):
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", endpoint.port)) for _ in range(100)]
    try:
        for s in idle:
            s.sendall(b"GET /metr")  # a request line that never ends
        time.sleep(0.3)
        assert threading.active_count() - before <= exposition.SERVE_THREADS
        # past the room, or past the client timeout, the server closes each of them
        deadline = time.monotonic() + 30
        for s in idle:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            assert s.recv(1024) == b""
    finally:
        for s in idle:
            s.close()
    assert b"gpuhedge_" in scrape(endpoint.port)
