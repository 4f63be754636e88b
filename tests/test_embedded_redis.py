"""The demo's embedded Redis (``store/embedded.py``) is built on fakeredis's public server only,
and keeps what makes Celery usable on it: ``TCP_NODELAY`` on accepted sockets, the short poll."""

from __future__ import annotations

import ast
import gc
import pathlib
import socket
import sys

import redis
from fakeredis import TcpFakeServer

from gpuhedge_celery.store import embedded

PACKAGE = pathlib.Path(embedded.__file__).resolve().parents[1]


def _private_fakeredis_imports(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "fakeredis" and any(p.startswith("_") for p in parts[1:]):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    return found


def test_the_package_imports_no_private_fakeredis_module():
    files = sorted(PACKAGE.rglob("*.py"))
    assert PACKAGE / "store" / "embedded.py" in files
    assert [hit for path in files for hit in _private_fakeredis_imports(path)] == []


def _server_side(client_end: socket.socket) -> socket.socket:
    """The embedded server's accepted socket for ``client_end`` (sockets of this process)."""
    peer = client_end.getsockname()
    for obj in gc.get_objects():
        if isinstance(obj, socket.socket) and obj.fileno() != -1:
            try:
                if obj.getpeername() == peer:
                    return obj
            except OSError:
                continue
    raise AssertionError(f"no accepted socket for {peer}")


def test_embedded_redis_answers_with_nagle_off_and_the_short_poll():
    server = embedded.start_embedded_redis()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
            conn.sendall(b"*1\r\n$4\r\nPING\r\n")
            assert conn.recv(64) == b"+PONG\r\n"
            accepted = _server_side(conn)
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        home = sys.modules[TcpFakeServer.__module__]
        assert getattr(home, "_POLL_INTERVAL", embedded._POLL_S) == embedded._POLL_S
        client = redis.Redis.from_url(server.url)
        assert client.eval("return redis.call('incr', KEYS[1])", 1, "k") == 1  # Lua (lupa)
        client.close()
    finally:
        server.stop()
