"""A real RabbitMQ for the tests: the machine's (``127.0.0.1:5672``), one fresh vhost per use.

A vhost is RabbitMQ's unit of isolation: queues, exchanges and remote-control broadcasts
(pidbox) of one vhost never reach another, so tests that each get their own vhost cannot mix,
just as tests on Redis cannot across their broker key prefixes.

``rabbitmqctl`` costs about 0.4 s of CPU per call (it boots an Erlang VM), so vhosts are made in
batches through one ``rabbitmqctl import_definitions`` call and deleted together at the end of
the session through one ``rabbitmqctl eval``; vhosts left by an earlier run that died (its
process id is gone) are deleted with them. Measured on the 2-core test machine: a batch of 8
vhosts is ready to take connections in 0.7-0.95 s, where one vhost made the plain way
(``add_vhost`` + ``set_permissions``) took 0.95 s and deleting it 0.4-1.7 s more.
``scripts/ensure-rabbitmq.sh`` (run by the README's test command) starts or installs the server;
here a missing server fails the test, never skips.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from urllib.parse import quote, urlsplit

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
VHOST_PREFIX = "gpuhedge-test-"
BATCH = 8
_VHOST_RE = re.compile(rf"^{VHOST_PREFIX}(\d+)-[0-9a-f]+-\d+$")


def amqp_url() -> str:
    """The RabbitMQ the tests use: ``GPUHEDGE_TEST_AMQP_URL`` or the machine's default one."""
    return os.environ.get("GPUHEDGE_TEST_AMQP_URL") or DEFAULT_AMQP_URL


def answers(url: str, timeout_s: float = 2.0) -> bool:
    """Whether an AMQP server accepts a connection (and the credentials) at ``url``."""
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=timeout_s) as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout_s)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return False


def with_vhost(url: str, vhost: str) -> str:
    """``url`` pointing at ``vhost`` instead of its own."""
    parts = urlsplit(url)
    return parts._replace(path="/" + quote(vhost, safe="")).geturl()


def _rabbitmqctl(*args: str, stdin: str | None = None) -> str:
    binary = shutil.which("rabbitmqctl")
    if binary is None:
        raise RuntimeError(
            "rabbitmqctl is not installed; run the README's test command (scripts/test.sh), "
            "which installs RabbitMQ"
        )
    done = subprocess.run(
        [binary, *args], input=stdin, capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {args[0]} failed: {done.stderr.strip() or done.stdout}")
    return done.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class VhostFactory:
    """Hands out fresh vhosts on one RabbitMQ (made in batches) and deletes them all at close."""

    def __init__(self, url: str, user: str | None = None):
        self.url = url
        self.user = user or urlsplit(url).username or "guest"
        self.tag = f"{VHOST_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._ready: list[str] = []
        self.made: list[str] = []
        self.create_s: list[float] = []  # seconds per batch, for whoever wants to know

    def _make_batch(self) -> None:
        names = [f"{self.tag}-{len(self.made) + i}" for i in range(BATCH)]
        definitions = {
            "vhosts": [{"name": n} for n in names],
            "permissions": [
                {"user": self.user, "vhost": n, "configure": ".*", "write": ".*", "read": ".*"}
                for n in names
            ],
        }
        started = time.monotonic()
        _rabbitmqctl("import_definitions", stdin=json.dumps(definitions))
        # The import is asynchronous: wait until the last vhost takes connections.
        deadline = time.monotonic() + 30
        while not answers(with_vhost(self.url, names[-1]), timeout_s=1.0):
            if time.monotonic() > deadline:
                raise RuntimeError(f"RabbitMQ did not create vhost {names[-1]} within 30 s")
            time.sleep(0.05)
        self.create_s.append(time.monotonic() - started)
        self.made.extend(names)
        self._ready.extend(names)

    def new_url(self) -> str:
        """An AMQP URL on a vhost nobody else has used."""
        if not self._ready:
            self._make_batch()
        return with_vhost(self.url, self._ready.pop(0))

    def close(self) -> None:
        """Delete this session's vhosts and those of test runs that died without deleting."""
        listed = _rabbitmqctl("list_vhosts", "--quiet", "--no-table-headers").split()
        stale = [v for v in listed if (m := _VHOST_RE.match(v)) and not _pid_alive(int(m.group(1)))]
        doomed = sorted(set(self.made) & set(listed) | set(stale))
        if not doomed:
            return
        erl = ",".join(f'<<"{v}">>' for v in doomed)
        try:
            _rabbitmqctl("eval", f'[rabbit_vhost:delete(V, <<"gpuhedge-tests">>) || V <- [{erl}]].')
        except RuntimeError:  # an internal API of another RabbitMQ version: one call each
            for vhost in doomed:
                _rabbitmqctl("delete_vhost", vhost)
