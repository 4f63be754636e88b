"""A real Prometheus server on loopback for end-to-end tests, and helpers to read endpoints.

``scripts/ensure-prometheus.sh`` (run by the test command) unpacks ``prometheus`` and
``promtool`` from Debian's package into a private directory that the test command puts on PATH
(the package is not installed: no service); a test that needs them fails, never skips, when
they are not there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import stop_process
from tests.support.redis_server import free_port

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def binary(name: str) -> str:
    """The path of ``prometheus`` or ``promtool``; AssertionError naming the fix if missing."""
    found = shutil.which(name)
    assert found, f"{name} is not on PATH: run the tests with scripts/test.sh"
    return found


def scrape(port: int, timeout: float = 5.0) -> Samples:
    """GET http://127.0.0.1:<port>/metrics and parse it with prometheus_client's parser."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        text = r.read().decode("utf-8")
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def sample(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 when absent: a counter never incremented is not exported)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for_endpoint(port: int, timeout: float = 30.0) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return scrape(port, timeout=2.0)
        except (OSError, urllib.error.URLError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@dataclass
class PrometheusServer:
    """A ``prometheus`` process of one test; ``stop()`` kills it and removes its data."""

    url: str
    process: subprocess.Popen
    workdir: Path

    def query(self, expr: str) -> list[dict]:
        """``/api/v1/query`` at the current time: the result vector."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The single value of an instant query (None when the vector is empty)."""
        result = self.query(expr)
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])

    def wait_value(self, expr: str, expected: float, timeout: float = 15.0) -> float | None:
        """Poll ``expr`` until it equals ``expected`` (to 1e-9) or ``timeout``; the last value."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.value(expr)
            if found is not None and abs(found - expected) < 1e-9:
                return found
            if time.monotonic() > deadline:
                return found
            time.sleep(0.25)

    def log(self) -> str:
        try:
            return (self.workdir / "prometheus.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        stop_process(self.process)
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_prometheus(
    jobs: dict[str, list[int]], workdir: Path, interval_s: float = 1.0
) -> PrometheusServer:
    """Start Prometheus scraping ``jobs`` (job name -> loopback ports) every ``interval_s``."""
    workdir.mkdir(parents=True, exist_ok=True)
    interval = f"{int(interval_s * 1000)}ms"
    lines = ["global:", f"  scrape_interval: {interval}", f"  scrape_timeout: {interval}",
             "scrape_configs:"]  # fmt: skip
    for job, ports in jobs.items():
        targets = ", ".join(f'"127.0.0.1:{p}"' for p in ports)
        lines += [f"  - job_name: {job}", "    static_configs:", f"      - targets: [{targets}]"]
    config = workdir / "prometheus.yml"
    config.write_text("\n".join(lines) + "\n")
    port = free_port()
    log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(
        [binary("prometheus"), f"--config.file={config}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    log.close()
    server = PrometheusServer(f"http://127.0.0.1:{port}", process, workdir)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited:\n{server.log()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=1) as r:
                if r.status == 200:
                    return server
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError("prometheus did not become ready in 30 s")
