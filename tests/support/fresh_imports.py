"""Run import statements each on its own, in interpreters where no gpuhedge_celery module is loaded.

Two ways, both starting from a new ``python`` process with ``GPUHEDGE_*`` variables removed:

* :func:`run_each` starts one interpreter per statement (what a user's script does). About half
  a second each (Celery's import), so it is for the handful of statements users type.
* :func:`run_each_forked` starts one interpreter that imports the third-party libraries the
  package builds on (Celery, redis-py, PyYAML...) but nothing of the package, and forks a child
  per statement. A circular import among the package's own modules fails the same way there,
  and the child costs only the package's own import, so every module can be checked.

Both return ``{statement: one-line error}`` for the statements that failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120

_FORK_DRIVER = r"""
import json, os, sys, traceback
statements = json.loads(sys.stdin.read())
for lib in ("celery", "celery.app.task", "kombu", "redis", "yaml", "click", "httpx", "orjson"):
    try:
        __import__(lib)
    except ImportError:
        pass
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "gpuhedge_celery")
assert not loaded, f"the driver must start without the package, found {loaded}"
failures = {}
for statement in statements:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            exec(compile(statement, "<fresh import>", "exec"), {"__name__": "fresh"})
            message, code = "", 0
        except BaseException as e:
            message = traceback.format_exception_only(type(e), e)[-1].strip()
            code = 1
        os.write(write_end, message.encode())
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failures[statement] = message or f"child exited with status {status}"
print(json.dumps(failures))
"""


def clean_env() -> dict[str, str]:
    """The test's environment without ``GPUHEDGE_*`` (a worker's role, a config path...), with
    this checkout first on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUHEDGE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _one(statement: str, cwd: Path) -> str | None:
    done = subprocess.run(
        [sys.executable, "-c", statement],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=clean_env(),
        cwd=str(cwd),
    )
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def run_each(statements: Iterable[str], cwd: Path, workers: int = 4) -> dict[str, str]:
    """Each statement in its own new interpreter (``workers`` at a time)."""
    statements = list(dict.fromkeys(statements))
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda s: _one(s, cwd), statements))
    return {s: error for s, error in zip(statements, results, strict=True) if error is not None}


def run_each_forked(statements: Iterable[str], cwd: Path) -> dict[str, str]:
    """Each statement in its own child of one clean interpreter (see the module's docstring)."""
    done = subprocess.run(
        [sys.executable, "-c", _FORK_DRIVER],
        input=json.dumps(list(dict.fromkeys(statements))),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=clean_env(),
        cwd=str(cwd),
    )
    if done.returncode != 0:
        raise RuntimeError(f"fork driver failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
