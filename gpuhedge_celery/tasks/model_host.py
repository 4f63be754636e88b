"""Warm models in GPU workers: loaded once per child after the fork, out of the pool until then.

A runner that must be loaded (``python:module:Class``, a module with ``load``/``run``) is built
by :class:`ModelLoader` in the GPU worker's prefork child, on a thread started from
``worker_process_init``, so CUDA is only ever touched in the child and Celery's start-up timeout
for a child (``worker_proc_alive_timeout``, 4 s) never cuts a long load short. The GPU takes no
lease while the model is not loaded:

* the main process marks the GPU out (reason ``runner``) before it forks the child
  (:func:`mark_runner_starting`, from ``celeryd_after_setup``);
* the child's loader says ``loading``, then either clears the mark (the GPU joins the pool and
  its waiters are woken) or says why the load failed and retries with exponential backoff
  (``GPUHEDGE_RUNNER_RETRY_S`` doubling up to ``GPUHEDGE_RUNNER_RETRY_MAX_S``);
* a child that exits (``--max-tasks-per-child``, ``--max-memory-per-child``, a clean shutdown)
  marks the GPU out again and closes its model (:func:`stop_child_runner`); the next child loads
  it again. A child killed with ``kill -9`` cannot say so: a job that reaches the new child before
  its model is loaded waits up to ``GPUHEDGE_RUNNER_WAIT_S`` under its renewed lease, then marks
  the GPU out again, frees the lease and waits for a GPU again (:func:`wait_ready`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ..core.lease_rules import OUT_RUNNER
from ..errors import GpuHedgeError
from ..runners import RunnerStopped, RunnerUnavailable, needs_load
from ..store.availability import clear_out, set_out
from ..store.leases import LeaseStore

log = logging.getLogger(__name__)

_child: dict[str, Any] = {}


class Backoff:
    """Exponential retry delays: ``first_s``, doubling, at most ``max_s``; :meth:`reset` after a
    success that lasted."""

    def __init__(self, first_s: float, max_s: float):
        self.first_s, self.max_s = first_s, max(first_s, max_s)
        self.delay = first_s

    def next(self) -> float:
        delay, self.delay = self.delay, min(self.delay * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self.delay = self.first_s


def mark_out(store: LeaseStore, gpu_id: str, detail: str) -> bool:
    """Keep the GPU out of the pool for its runner (``detail`` says why); False if Redis failed."""
    try:
        set_out(store, gpu_id, OUT_RUNNER, detail)
        return True
    except GpuHedgeError as e:
        log.warning("could not mark GPU %s out of the pool (%s): %s", gpu_id, detail, e)
        return False


def mark_in(store: LeaseStore, gpu_id: str) -> bool:
    """The runner serves: clear its mark (the GPU joins the pool unless another reason holds)."""
    try:
        clear_out(store, gpu_id, OUT_RUNNER)
        return True
    except GpuHedgeError as e:
        log.warning("could not put GPU %s back into the pool: %s", gpu_id, e)
        return False


class ModelLoader:
    """Loads one runner in this process, retrying with backoff; the GPU is out until it is ready."""

    def __init__(
        self, runner: Any, store: LeaseStore, gpu_id: str, *, retry_s: float, retry_max_s: float
    ):
        self.runner, self.store, self.gpu_id = runner, store, gpu_id
        self.backoff = Backoff(retry_s, retry_max_s)
        self.attempts = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ModelLoader:
        mark_out(self.store, self.gpu_id, f"loading {self.runner.spec} in child {os.getpid()}")
        self._thread = threading.Thread(target=self._load, name="gpuhedge-model-load", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _load(self) -> None:
        while not self._stop.is_set():
            self.attempts += 1
            started = time.monotonic()
            try:
                self.runner.load()
            except Exception as e:  # noqa: BLE001 - any load failure keeps the GPU out, retried
                delay = self.backoff.next()
                self.error = (
                    f"load of {self.runner.spec} failed (attempt {self.attempts}): "
                    f"{type(e).__name__}: {e}"
                )
                log.error("%s; retrying in %g s", self.error, delay)
                mark_out(self.store, self.gpu_id, f"{self.error}; retrying in {delay:g} s")
                self._stop.wait(delay)
                continue
            self.error = None
            log.info("model %s loaded in %.2f s", self.runner.spec, time.monotonic() - started)
            delay = self.backoff.first_s
            while not self._stop.is_set() and not mark_in(self.store, self.gpu_id):
                self._stop.wait(delay)  # Redis is down: the GPU joins once it answers again
                delay = min(delay * 2, self.backoff.max_s)
            return


def mark_runner_starting(store: LeaseStore, gpu_id: str, runner: Any) -> None:
    """Main process, before the fork: a runner that must load (or a model server that must be
    ready) keeps the GPU out until its child (or supervisor) says it serves; any other runner
    clears a mark a previous configuration may have left."""
    from ..server_runner import ServerRunner

    if needs_load(runner):
        mark_out(store, gpu_id, f"starting: {runner.spec} loads in the worker's child")
    elif isinstance(runner, ServerRunner):
        mark_out(store, gpu_id, f"starting: waiting for the model server ({runner.ready_url})")
    else:
        mark_in(store, gpu_id)


def start_child_runner(store: LeaseStore, gpu_id: str, runner: Any, config: Any) -> None:
    """In the GPU worker's child (``worker_process_init``): start loading its model."""
    if not needs_load(runner):
        return
    _child["loader"] = ModelLoader(
        runner,
        store,
        gpu_id,
        retry_s=config.runner_retry_s,
        retry_max_s=config.runner_retry_max_s,
    ).start()
    _child["runner"], _child["store"], _child["gpu_id"] = runner, store, gpu_id


def stop_child_runner(detail: str | None = None) -> None:
    """In an exiting child (``worker_process_shutdown``): out of the pool, then close the model.
    ``detail`` says why in the out-of-pool mark (default: the child exited)."""
    loader = _child.pop("loader", None)
    if loader is None:
        return
    loader.stop()
    mark_out(
        _child["store"],
        _child["gpu_id"],
        detail or f"child {os.getpid()} exited: {loader.runner.spec} loads again in the next child",
    )
    try:
        _child["runner"].close()
    except Exception:  # noqa: BLE001 - exiting anyway
        log.exception("closing %s failed", loader.runner.spec)


def wait_ready(runner: Any, stop: threading.Event, wait_s: float) -> None:
    """Before a job: wait (at most ``wait_s``, or until ``stop``) for the runner to be loaded;
    RunnerUnavailable if it is not, naming why (still loading, or the last load error)."""
    ready = getattr(runner, "ready", None)
    if ready is None or ready.is_set() or "loader" not in _child:
        return  # nothing to wait for, or no loader here: run() loads it inline
    deadline = time.monotonic() + wait_s
    while not ready.wait(0.05):
        if stop.is_set():
            raise RunnerStopped(f"stopped while waiting for {runner.spec} to load")
        if time.monotonic() >= deadline:
            loader = _child["loader"]
            why = loader.error or "its model is still loading"
            # The GPU must not take another lease it cannot serve: out again (the loader puts it
            # back once the model loads; if that happened just now, back at once).
            mark_out(loader.store, loader.gpu_id, f"{runner.spec} cannot serve yet: {why}")
            if ready.is_set():
                mark_in(loader.store, loader.gpu_id)
                return
            raise RunnerUnavailable(f"{runner.spec} cannot serve yet: {why}")
