"""Pluggable inference runners: what a GPU worker actually does with a request.

A runner turns one request (any JSON value) into a result (any JSON value) while its GPU lease is
held. Three kinds, chosen by a spec string (per pool, see docs/gpu-workers.md):

``cpu[:DIST][;seed=N]``
    Sleeps for a duration drawn from ``DIST`` then echoes the request: the stand-in GPU for tests,
    benchmarks and the demo. ``DIST`` is ``fixed=S``, ``uniform=LO,HI`` or ``lognormal=MEAN,SIGMA``
    (seconds; ``MEAN`` is the distribution's mean, not its median). A request that is a dict with
    ``duration_s`` overrides the draw, so a test can ask for an exact job length.
``python:module:Class`` / ``python:module`` / ``python:module:function``
    A model kept warm in the GPU worker's child: ``Class()`` then its ``load()`` (or the module's
    ``load()``) once per child, after the fork, then ``run(request, ctx)`` per job; ``close()``
    when the child exits. A plain function is called per job. Nothing is imported before
    :meth:`PythonRunner.load` (the GPU worker calls it in its child, retrying with backoff).
``server:URL[;timeout=S][;ready=URL][;idle=URL][;idle_metric=NAME][;drain=S][;boot=S]``
    POSTs the request as JSON to a model server on the GPU host (OpenAI-compatible or plain
    HTTP) and returns its JSON answer (:mod:`gpuhedge_celery.server_runner`).
``cmd:COMMAND LINE``
    Starts the command (no shell), writes the request as JSON to its stdin and reads its stdout as
    JSON (or text): the bridge to a real model server or script.

Every runner gets a :class:`RunContext` whose ``stop`` event is set when the worker loses the GPU
lease. ``cpu`` and ``cmd`` runners stop at once (the subprocess is terminated); a ``python``
runner that ignores ``ctx`` cannot be interrupted, so its result is fenced instead: the worker
discards it and reports the lease loss.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import math
import random
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import ConfigError
from .run_context import RunContext, RunnerFailed, RunnerStopped, RunnerUnavailable, child_env

DEFAULT_RUNNER = "cpu"

__all__ = [
    "CallableRunner",
    "CommandRunner",
    "CpuRunner",
    "Duration",
    "PythonRunner",
    "RunContext",
    "Runner",
    "RunnerFailed",
    "RunnerStopped",
    "RunnerUnavailable",
    "needs_load",
    "runner_from_spec",
]


class Runner(Protocol):
    """Runs one request on the GPU this process owns."""

    @property
    def spec(self) -> str: ...  # read-only: runners may be frozen dataclasses

    def run(self, request: Any, ctx: RunContext) -> Any: ...


def needs_load(runner: Any) -> bool:
    """Whether ``runner`` must be loaded in the GPU worker's child before it serves."""
    return callable(getattr(runner, "load", None))


def _takes_ctx(func: Callable[..., Any]) -> bool:
    try:
        return len(inspect.signature(func).parameters) >= 2
    except (TypeError, ValueError):
        return False


def _call_fenced(
    spec: str, func: Callable[..., Any], takes_ctx: bool, request: Any, ctx: RunContext
) -> Any:
    """``func(request[, ctx])``; its exceptions (but a stop) as RunnerFailed naming ``spec``."""
    try:
        result = func(request, ctx) if takes_ctx else func(request)
    except RunnerStopped:
        raise
    except Exception as e:
        raise RunnerFailed(f"{spec} raised {type(e).__name__}: {e}") from e
    ctx.check()  # fencing: a result produced after the lease was lost is never returned
    return result


@dataclass(frozen=True)
class Duration:
    """A seeded distribution of job lengths in seconds: ``fixed``, ``uniform`` or ``lognormal``."""

    kind: str = "fixed"
    a: float = 0.0  # fixed: the value; uniform: low; lognormal: mean
    b: float = 0.0  # uniform: high; lognormal: sigma of the underlying normal
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ConfigError(
                f"expected fixed, uniform or lognormal, got {self.kind!r}", key="dist"
            )
        if self.a < 0 or self.b < 0:
            raise ConfigError(f"durations must be >= 0, got {self.a}, {self.b}", key=self.kind)
        if self.kind == "uniform" and self.b < self.a:
            raise ConfigError(f"expected LO <= HI, got {self.a}, {self.b}", key="uniform")
        if self.kind == "lognormal" and self.a <= 0:
            raise ConfigError(f"expected a mean > 0, got {self.a}", key="lognormal")

    @property
    def mean(self) -> float:
        """The distribution's mean in seconds."""
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a

    def sampler(self) -> Callable[[], float]:
        """A function drawing successive durations from this distribution's own seeded stream."""
        rng = random.Random(self.seed)
        if self.kind == "fixed":
            return lambda: self.a
        if self.kind == "uniform":
            return lambda: rng.uniform(self.a, self.b)
        # Parametrised by the mean so "mean job 0.25 s" means what it says: mu = ln(mean) - s²/2.
        mu = math.log(self.a) - self.b**2 / 2
        return lambda: rng.lognormvariate(mu, self.b)

    @classmethod
    def parse(cls, text: str, seed: int | None = None) -> Duration:
        """Parse ``fixed=S``, ``uniform=LO,HI`` or ``lognormal=MEAN,SIGMA``."""
        kind, sep, args = text.partition("=")
        kind = kind.strip()
        try:
            values = [float(v) for v in args.split(",")] if sep else []
        except ValueError:
            raise ConfigError(f"expected numbers, got {args!r}", key=kind) from None
        wanted = {"fixed": 1, "uniform": 2, "lognormal": 2}.get(kind)
        if wanted is None:
            raise ConfigError(f"expected fixed, uniform or lognormal, got {kind!r}", key="dist")
        if len(values) != wanted:
            raise ConfigError(f"expected {wanted} number(s), got {args!r}", key=kind)
        return cls(kind, values[0], values[1] if wanted == 2 else 0.0, seed)


class CpuRunner:
    """Sleeps for a drawn duration (interruptibly) and echoes the request: a simulated GPU."""

    def __init__(self, duration: Duration | None = None, spec: str = "cpu"):
        self.duration = duration or Duration()
        self.spec = spec
        self._draw = self.duration.sampler()
        self._lock = threading.Lock()

    def run(self, request: Any, ctx: RunContext) -> Any:
        if isinstance(request, dict) and "duration_s" in request:
            seconds = float(request["duration_s"])
        else:
            with self._lock:
                seconds = self._draw()
        started = time.monotonic()
        if ctx.stop.wait(seconds):
            raise RunnerStopped(
                f"job on GPU {ctx.gpu_id!r} stopped after "
                f"{time.monotonic() - started:.2f}s of {seconds:.2f}s: its lease was lost"
            )
        return {"echo": request, "gpu_id": ctx.gpu_id, "token": ctx.token, "duration_s": seconds}


class CallableRunner:
    """Calls a Python function ``module:name`` with the request (and the context if it takes it)."""

    def __init__(self, path: str, spec: str | None = None):
        module_name, sep, attr = path.partition(":")
        if not sep or not module_name or not attr:
            raise ConfigError(f"expected 'module:function', got {path!r}", key="runner")
        try:
            func = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"cannot load {path!r}: {e}", key="runner") from e
        if not callable(func):
            raise ConfigError(f"{path!r} is not callable", key="runner")
        self.func = func
        self.spec = spec or f"python:{path}"
        self._takes_ctx = _takes_ctx(func)

    def run(self, request: Any, ctx: RunContext) -> Any:
        return _call_fenced(self.spec, self.func, self._takes_ctx, request, ctx)


class PythonRunner:
    """A model kept warm in the process that loads it: ``module:Class``, a module with ``load`` /
    ``run``, or a plain function ``module:function``.

    :meth:`load` imports the module and builds the model (``Class()`` then its ``load()``, or the
    module's ``load()``); :attr:`ready` is set once that succeeded. The GPU worker calls it once
    per child, after the fork, so CUDA is only touched there. :meth:`run` loads first if nobody
    did (handy outside a worker). Results are fenced like :class:`CallableRunner`'s.
    """

    def __init__(self, target: str, spec: str | None = None):
        module_name, _, attr = target.partition(":")
        if not module_name or not all(p.isidentifier() for p in module_name.split(".")):
            raise ConfigError(
                f"expected 'module:Class', 'module' or 'module:function', got {target!r}",
                key="runner",
            )
        try:
            found = importlib.util.find_spec(module_name)
        except (ImportError, ValueError) as e:
            raise ConfigError(f"cannot find module {module_name!r}: {e}", key="runner") from e
        if found is None:
            raise ConfigError(f"cannot find module {module_name!r}", key="runner")
        self.module_name, self.attr = module_name, attr
        self.spec = spec or f"python:{target}"
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self._run: Callable[..., Any] | None = None
        self._close: Callable[[], Any] | None = None
        self._takes_ctx = False

    def load(self) -> None:
        """Import and build the model once (again after :meth:`close`); raises what it raised."""
        with self._lock:
            if self.ready.is_set():
                return
            try:
                module = importlib.import_module(self.module_name)
                target = getattr(module, self.attr) if self.attr else module
            except AttributeError as e:
                raise ConfigError(f"cannot load {self.spec!r}: {e}", key="runner") from e
            if inspect.isclass(target):
                target = target()  # the model object: one per child
            loader = getattr(target, "load", None)
            run: Any
            if inspect.isfunction(target) or inspect.isbuiltin(target):
                run, loader = target, None
            else:
                run = getattr(target, "run", None)
            if not callable(run):
                raise ConfigError(f"{self.spec!r} has no run(request[, ctx])", key="runner")
            if callable(loader):
                loader()
            self._run, self._takes_ctx = run, _takes_ctx(run)
            closer = getattr(target, "close", None)
            self._close = closer if callable(closer) and run is not target else None
            self.ready.set()

    def close(self) -> None:
        """Let the model go (its ``close()``, if any); a later :meth:`load` builds it again."""
        with self._lock:
            closer, self._close, self._run = self._close, None, None
            self.ready.clear()
        if closer is not None:
            closer()

    def run(self, request: Any, ctx: RunContext) -> Any:
        if not self.ready.is_set():
            self.load()
        run = self._run
        if run is None:
            raise RunnerUnavailable(f"{self.spec} is not loaded")
        return _call_fenced(self.spec, run, self._takes_ctx, request, ctx)


class CommandRunner:
    """Runs a command per request: JSON on stdin, JSON (or text) result on stdout."""

    poll_s = 0.05

    def __init__(self, argv: list[str], spec: str | None = None):
        if not argv:
            raise ConfigError("expected a command after 'cmd:'", key="runner")
        self.argv = argv
        self.spec = spec or "cmd:" + shlex.join(argv)

    def run(self, request: Any, ctx: RunContext) -> Any:
        env = child_env(ctx.env)
        try:
            proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                text=True,
            )
        except OSError as e:
            raise RunnerFailed(f"cannot start {self.argv[0]!r}: {e}") from e
        # A thread feeds stdin and drains the pipes, so this thread can watch the stop flag.
        out: dict[str, str] = {}

        def talk() -> None:
            out["stdout"], out["stderr"] = proc.communicate(json.dumps(request))

        talker = threading.Thread(target=talk, daemon=True)
        talker.start()
        while talker.is_alive():
            if ctx.stop.wait(self.poll_s):
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                talker.join(5)
                raise RunnerStopped(f"command on GPU {ctx.gpu_id!r} terminated: lease lost")
            talker.join(0)
        if proc.returncode != 0:
            tail = (out.get("stderr") or "").strip().splitlines()[-1:] or ["no stderr"]
            raise RunnerFailed(f"{self.argv[0]} exited with {proc.returncode}: {tail[0][:200]}")
        text = out.get("stdout") or ""
        try:
            return json.loads(text)
        except ValueError:
            return text.rstrip("\n")


def runner_from_spec(spec: str | None) -> Runner:
    """Build the runner a spec string names (see the module docstring); ConfigError if invalid."""
    spec = (spec or DEFAULT_RUNNER).strip()
    kind, _, rest = spec.partition(":")
    if kind == "cpu":
        seed = None
        dist_text, _, opts = rest.partition(";")
        for opt in filter(None, opts.split(";")):
            key, _, value = opt.partition("=")
            if key != "seed" or not value.lstrip("-").isdigit():
                raise ConfigError(f"expected ';seed=N', got {opt!r}", key=spec)
            seed = int(value)
        duration = Duration.parse(dist_text, seed) if dist_text else Duration(seed=seed)
        return CpuRunner(duration, spec=spec)
    if kind == "python":
        return PythonRunner(rest, spec=spec)
    if kind == "server":
        from .server_runner import ServerRunner

        return ServerRunner.parse(rest, spec=spec)
    if kind == "cmd":
        try:
            argv = shlex.split(rest)
        except ValueError as e:
            raise ConfigError(f"cannot parse the command line: {e}", key=spec) from None
        return CommandRunner(argv, spec=spec)
    raise ConfigError(
        f"expected a runner spec 'cpu[:DIST]', 'python:module:Class', 'cmd:COMMAND' or "
        f"'server:URL', got {spec!r}",
        key="runner",
    )
