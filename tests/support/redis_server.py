"""Real redis-server processes for tests: the shared one, or a private one on a free port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

import redis

from tests.support.processes import stop_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        return True
    except redis.RedisError:
        return False


@dataclass
class RedisServer:
    """A redis-server this test run started; ``stop()`` kills it and removes its files."""

    url: str
    port: int
    process: subprocess.Popen
    workdir: str

    def stop(self) -> None:
        stop_process(self.process, grace_s=5)
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_redis_server(*extra_args: str) -> RedisServer:
    """Start a private redis-server (no persistence) on a free loopback port and wait for it."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(
            "redis-server is not installed; run the README's test command (scripts/test.sh), "
            "which installs it"
        )
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="gpuhedge-redis-")
    args = [
        binary,
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--save", "",
        "--appendonly", "no",
        "--dir", workdir,
        *extra_args,
    ]  # fmt: skip
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if answers(url):
            return RedisServer(url=url, port=port, process=process, workdir=workdir)
        if process.poll() is not None:
            break
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"redis-server on port {port} did not start")


def shared_redis_url() -> tuple[str, RedisServer | None]:
    """The test run's Redis: $GPUHEDGE_TEST_REDIS_URL, else 127.0.0.1:6379, else a new server."""
    for url in (os.environ.get("GPUHEDGE_TEST_REDIS_URL"), "redis://127.0.0.1:6379/0"):
        if url and answers(url):
            return url, None
    server = start_redis_server()
    return server.url, server
