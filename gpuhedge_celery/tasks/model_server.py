"""The model server next to a GPU worker (``server:`` runner): start it, watch it, restart it.

:class:`ServerSupervisor` runs on a thread of the GPU worker's main process, which never touches
CUDA itself: the server process does, and it outlives the worker's prefork children (a recycled
or killed child costs no model reload). With ``GPUHEDGE_SERVER_CMD`` the supervisor starts the
server (its own process group, ``CUDA_VISIBLE_DEVICES`` inherited, sent SIGTERM if the worker
dies), waits until its readiness URL answers 2xx (at most the runner's ``boot`` seconds), and
restarts it with exponential backoff when it exits or stops being ready. Without a command it
watches a server that is already running. Either way the GPU is out of the pool (reason
``runner``) whenever the server cannot serve, and back as soon as it can.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shlex
import signal
import subprocess
import threading
import time

from ..run_context import child_env
from ..server_runner import ServerRunner
from ..store.leases import LeaseStore
from .model_host import Backoff, mark_in, mark_out

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the supervisor looks at the server process
PROBE_S = 1.0  # how often it probes readiness while the server serves
FAILED_PROBES = 3  # consecutive failed probes that take the GPU out of the pool
STABLE_S = 60.0  # a server that served this long starts the backoff again from the first delay
TERM_S = 10.0  # SIGTERM, then SIGKILL after this long

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked server process
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class ServerSupervisor:
    """Keeps one model server serving and the GPU's pool membership in line with it."""

    def __init__(
        self,
        runner: ServerRunner,
        command: str | None,
        store: LeaseStore,
        gpu_id: str,
        *,
        retry_s: float,
        retry_max_s: float,
    ):
        self.runner, self.store, self.gpu_id = runner, store, gpu_id
        self.argv = shlex.split(command) if command else None
        self.backoff = Backoff(retry_s, retry_max_s)
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ServerSupervisor:
        self._thread = threading.Thread(target=self._loop, name="gpuhedge-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop supervising; a server this worker started is terminated (its whole group)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(TERM_S + 5)
        self._kill()

    # -- the loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            why = self._bring_up()
            if why is None:
                up_since = time.monotonic()
                self.ready.set()
                mark_in(self.store, self.gpu_id)
                log.info("model server %s is ready: GPU %s serves", self.runner.url, self.gpu_id)
                why = self._watch()
                self.ready.clear()
                if why is None:
                    return  # stopping
                if time.monotonic() - up_since >= STABLE_S:
                    self.backoff.reset()
            if self._stop.is_set():
                return
            if self.argv is None:
                mark_out(self.store, self.gpu_id, f"model server not ready: {why}")
                log.warning("model server %s not ready: %s", self.runner.url, why)
                continue  # _bring_up probes again until it is
            delay = self.backoff.next()
            mark_out(self.store, self.gpu_id, f"{why}; restarting it in {delay:g} s")
            log.error("model server %s: %s; restarting it in %g s", self.runner.url, why, delay)
            self._kill()
            self._stop.wait(delay)

    def _bring_up(self) -> str | None:
        """Start the server (with a command) and wait until it is ready: None, or why not."""
        if self.argv is not None:
            try:
                self.process = subprocess.Popen(
                    self.argv,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                    env=child_env(),
                )
            except OSError as e:
                return f"cannot start the model server {self.argv[0]!r}: {e}"
            self.starts += 1
            mark_out(
                self.store,
                self.gpu_id,
                f"starting the model server (pid {self.process.pid}): waiting for "
                f"{self.runner.ready_url}",
            )
        deadline = time.monotonic() + self.runner.boot_s
        why, said = "stopping", ""
        while not self._stop.is_set():
            exited = self._exited()
            if exited is not None:
                return exited
            ready, why = self.runner.probe_ready()
            if ready:
                return None
            if self.argv is None and why != said:  # say why a running server does not serve
                mark_out(self.store, self.gpu_id, f"model server not ready: {why}")
                said = why
            if self.argv is not None and time.monotonic() >= deadline:
                return f"model server not ready after {self.runner.boot_s:g} s: {why}"
            self._stop.wait(POLL_S if self.argv is not None else PROBE_S)
        return why

    def _watch(self) -> str | None:
        """While the server serves: None when stopping, else why it no longer serves."""
        failed, next_probe = 0, time.monotonic() + PROBE_S
        while not self._stop.wait(POLL_S):
            exited = self._exited()
            if exited is not None:
                return exited
            if time.monotonic() < next_probe:
                continue
            next_probe = time.monotonic() + PROBE_S
            ready, why = self.runner.probe_ready()
            failed = 0 if ready else failed + 1
            if failed >= FAILED_PROBES:
                return f"model server stopped answering its readiness probe: {why}"
        return None

    def _exited(self) -> str | None:
        if self.process is None:
            return None
        code = self.process.poll()
        return None if code is None else f"model server exited with code {code}"

    def _kill(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(TERM_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)
        except ProcessLookupError:
            pass
