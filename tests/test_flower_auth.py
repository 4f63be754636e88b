"""What the README and docs/flower.md say about Flower holds for a real Flower process: its API
answers 401 until authentication is configured, FLOWER_BASIC_AUTH (or --basic-auth) protects
pages and API, and FLOWER_UNAUTHENTICATED_API=true opens the API on a trusted network."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.waiting import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[1]
USER, PASSWORD = "ops", "flower-test-secret"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def flower(redis_url: str, prefix: str, tmp_path: Path, *args: str, **env: str) -> Iterator:
    """``celery -A gpuhedge_celery flower`` on a free loopback port; its HTTP client."""
    port = free_port()
    log_path = tmp_path / f"flower-{port}.log"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}
    full_env.update(GPUHEDGE_REDIS_URL=redis_url, GPUHEDGE_BROKER_PREFIX=f"{prefix}:", **env)
    argv = [sys.executable, "-m", "celery", "-A", "gpuhedge_celery", "flower",
            f"--port={port}", "--address=127.0.0.1", *args]  # fmt: skip
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            argv, env=full_env, stdout=log_file, stderr=subprocess.STDOUT, cwd=str(tmp_path),
            start_new_session=True,
        )  # fmt: skip
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)

    def answers() -> bool:
        assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
        try:
            http.get("/healthcheck")
            return True
        except httpx.TransportError:
            return False

    try:
        wait_for(answers, 30, "Flower to answer HTTP", every_s=0.1)
        yield http
    finally:
        http.close()
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(10)


def codes(http: httpx.Client, auth: tuple[str, str] | None = None) -> dict[str, int]:
    return {path: http.get(path, auth=auth).status_code for path in ("/", "/api/tasks")}


def test_the_readme_names_the_extra_and_the_api_authentication():
    readme = (REPO / "README.md").read_text()
    docs = (REPO / "docs" / "flower.md").read_text()
    for text in (readme, docs):
        assert "pip install 'gpuhedge-celery[flower]'" in text
        assert "FLOWER_UNAUTHENTICATED_API=true" in text
        assert "FLOWER_BASIC_AUTH=" in text and "--basic-auth=" in text
        assert re.search(r"answers (`)?401", text)
    extras = (REPO / "setup.cfg").read_text()
    assert re.search(r"^flower =\n    flower>=", extras, re.M)


def test_without_authentication_the_pages_are_open_and_the_api_answers_401(
    redis_url, prefix, tmp_path
):
    with flower(redis_url, prefix, tmp_path) as http:
        assert codes(http) == {"/": 200, "/api/tasks": 401}
        assert "FLOWER_UNAUTHENTICATED_API" in http.get("/api/tasks").text


@pytest.mark.parametrize("how", ["env", "option"])
def test_basic_auth_protects_pages_and_api(redis_url, prefix, tmp_path, how):
    credentials = f"{USER}:{PASSWORD}"
    if how == "env":
        context = flower(redis_url, prefix, tmp_path, FLOWER_BASIC_AUTH=credentials)
    else:
        context = flower(redis_url, prefix, tmp_path, f"--basic-auth={credentials}")
    with context as http:
        assert codes(http) == {"/": 401, "/api/tasks": 401}
        assert codes(http, auth=(USER, "wrong")) == {"/": 401, "/api/tasks": 401}
        assert codes(http, auth=(USER, PASSWORD)) == {"/": 200, "/api/tasks": 200}


def test_unauthenticated_api_on_a_trusted_network(redis_url, prefix, tmp_path):
    with flower(redis_url, prefix, tmp_path, FLOWER_UNAUTHENTICATED_API="true") as http:
        assert codes(http) == {"/": 200, "/api/tasks": 200}
        assert http.get("/api/tasks").json() == {}
