"""Which tier a test belongs to, read from what it uses (tests/conftest.py applies it).

``redis``: its fixtures reach a real redis-server. ``celery``: they start Celery worker processes.
``server``: it starts another process or needs another server (a provider fake in its own
process, RabbitMQ, Prometheus, a CLI run in a subprocess). A test is found out through its
fixtures (by name below, or because a fixture's own code starts a process) and through its own
code: the names it uses are followed through the modules of this repository to any use of
``subprocess``, ``multiprocessing`` or the like. ``fast`` is every test with none of these marks
and not ``slow``. What static reading misses (a process started behind a CLI's dispatch) the
``--fast`` run's guard catches: a process started there fails the test (``ProcessGuard``).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import os
import pathlib
import socket
import subprocess
import urllib.parse
from collections.abc import Iterable, Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Fixtures that reach a real server or start workers, whatever their code looks like
# (redis_url may only connect to the machine's redis-server; broker may pick RabbitMQ).
REDIS_FIXTURES = frozenset({"redis_url", "private_redis", "silent_redis"})
CELERY_FIXTURES = frozenset({"celery_cluster", "race_cluster"})
SERVER_FIXTURES = frozenset({"amqp_vhosts", "runpod_fake_process"})
TIER_MARKS = ("redis", "celery", "server")

# Modules whose every use starts a process, and attributes that do so on modules that mostly don't.
SPAWN_MODULES = ("subprocess", "multiprocessing", "pty")
SPAWN_ATTRS = {
    "os": {
        "fork",
        "forkpty",
        "system",
        "popen",
        "posix_spawn",
        "posix_spawnp",
        "spawnv",
        "spawnl",
        "execv",
        "execvp",
    },
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
    "concurrent.futures": {"ProcessPoolExecutor"},
}

# Tools run to read the machine, not servers or workers (matplotlib's first import lists the
# fonts with fc-list; ctypes.util.find_library asks ldconfig; a GPU worker asks nvidia-smi).
MACHINE_TOOLS = frozenset({"fc-list", "ldconfig", "uname", "nvidia-smi"})


def _spawns_module(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in SPAWN_MODULES)


def _module_path(module: str) -> pathlib.Path | None:
    if not (ROOT / module.split(".")[0]).exists():  # only this repository's modules are read
        return None
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    return ".".join(parts[:keep] + ([node.module] if node.module else []))


class _Module:
    """One module's imports and top-level definitions, and which definitions start processes."""

    def __init__(self, name: str, path: pathlib.Path):
        self.name = name
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        self.imported: dict[str, tuple[str, str | None]] = {}  # local name -> (module, attr)
        self.defs: dict[str, ast.AST] = {}
        self.bases: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                self.bases.update(base.id for base in node.bases if isinstance(base, ast.Name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    local = alias.asname or alias.name.split(".")[0]
                    target = alias.name if alias.asname else alias.name.split(".")[0]
                    self.imported[local] = (target, None)
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(name, node, is_package)
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (source, alias.name)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.defs[node.name] = node
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        self.defs[target.id] = node

    def uses(self, node: ast.AST) -> Iterator[tuple[str, str | None]]:
        """(name, attribute) for every name ``node`` runs with; attribute for ``name.attr``
        (annotations are left out: they run nothing)."""
        stack = [node]
        while stack:
            sub = stack.pop()
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
                yield sub.value.id, sub.attr
            elif isinstance(sub, ast.Name):
                yield sub.id, None
            for field, value in ast.iter_fields(sub):
                if field not in ("annotation", "returns"):
                    values = value if isinstance(value, list) else [value]
                    stack.extend(v for v in values if isinstance(v, ast.AST))

    def name_spawns(self, name: str, attr: str | None, seen: set[tuple[str, str]]) -> bool:
        if name in self.imported and not self.follows(name):
            module, imported_attr = self.imported[name]
            return _spawns_module(module) or (attr or imported_attr) in SPAWN_ATTRS.get(module, ())
        if name in self.imported:
            module, imported_attr = self.imported[name]
            if imported_attr is None:  # import module [as name]
                if _spawns_module(module):
                    return True
                if attr is not None and attr in SPAWN_ATTRS.get(module, ()):
                    return True
                return attr is not None and _spawns(module, attr, seen)
            if _spawns_module(module) or imported_attr in SPAWN_ATTRS.get(module, ()):
                return True
            return _spawns(module, imported_attr, seen) or _spawns(
                f"{module}.{imported_attr}", attr, seen
            )
        return name in self.defs and _spawns(self.name, name, seen)

    def follows(self, name: str) -> bool:
        """Whether a use of imported ``name`` is followed into its module: always from tests;
        in the package only to a base class (a package function that merely builds or imports
        something that can start a process mostly does not start it: following every such
        reference would put nearly every test that reads a config or the CLI out of the fast
        tier; what this misses is caught by the fast tier's guard)."""
        return not self.name.startswith("gpuhedge_celery") or name in self.bases or _DEEP[0]

    def node_spawns(self, node: ast.AST, seen: set[tuple[str, str]]) -> bool:
        return any(self.name_spawns(name, attr, seen) for name, attr in self.uses(node))


@functools.cache
def _module(name: str) -> _Module | None:
    path = _module_path(name)
    return _Module(name, path) if path else None


_SPAWNS: set[tuple[str, str, bool]] = set()
_QUIET: set[tuple[str, str, bool]] = set()
_DEEP = [False]  # following a CLI command's callback: everything it reaches may run


def _spawns(module: str, name: str | None, seen: set[tuple[str, str]]) -> bool:
    """Whether ``module.name`` (a function, class or value defined there) starts a process."""
    key = (module, name or "")
    if name is None or key in seen or (*key, _DEEP[0]) in _QUIET:
        return False
    if (*key, _DEEP[0]) in _SPAWNS:
        return True
    seen.add(key)
    info = _module(module)
    found = False
    if info is not None and name in info.defs:
        found = info.node_spawns(info.defs[name], seen)
    elif info is not None and name in info.imported:
        found = info.name_spawns(name, None, seen)
    if found:
        _SPAWNS.add((*key, _DEEP[0]))
    return found


@functools.cache
def function_spawns(func: Any) -> bool:
    """Whether a test's or fixture's own code (followed through this repository) starts one."""
    func = getattr(func, "__wrapped__", func)
    module_name = getattr(func, "__module__", "")
    info = _module(module_name)
    if info is None:
        return False
    qualname = getattr(func, "__qualname__", "").split(".")
    node = info.defs.get(qualname[0])
    for part in qualname[1:]:  # a method of a test class
        if node is None or part == "<locals>":
            break
        node = next(
            (n for n in getattr(node, "body", []) if getattr(n, "name", None) == part), None
        )
    if node is None:
        return False
    seen: set[tuple[str, str]] = set()
    if info.node_spawns(node, seen) or any(_command_spawns(tuple(a)) for a in _cli_args(node)):
        return True
    _QUIET.update((*key, _DEEP[0]) for key in seen)  # all explored, none starts a process
    return False


def _cli_args(node: ast.AST) -> Iterator[list[str]]:
    """Literal argument lists in ``node`` that may be a CLI invocation: ``["bench", "report"]``
    or ``"bench report".split()``."""
    for sub in ast.walk(node):
        items: list[Any] = []
        if isinstance(sub, ast.List | ast.Tuple):
            items = [getattr(e, "value", None) for e in sub.elts[:3]]
        elif (
            isinstance(sub, ast.Call)
            and isinstance(sub.func, ast.Attribute)
            and sub.func.attr == "split"
            and isinstance(sub.func.value, ast.Constant)
        ):
            items = str(sub.func.value.value).split()[:3]
        words = [w for w in items if isinstance(w, str)]
        if words and len(words) == len(items[: len(words)]):
            yield words


@functools.cache
def _command_spawns(args: tuple[str, ...] | list[str]) -> bool:
    """Whether the ``gpuhedge-celery`` command that ``args`` names starts a process when run
    (a test running it through click's CliRunner reaches it only by name)."""
    import click

    from gpuhedge_celery.cli import cli

    command: Any = cli
    for word in args:
        if not isinstance(command, click.Group):
            break
        try:
            command = command.get_command(click.Context(command), word)
        except Exception:  # a command module that does not import is no process
            return False
        if command is None:
            return False
    if command is cli:
        return False
    _DEEP[0] = True
    try:
        return function_spawns.__wrapped__(command.callback)
    finally:
        _DEEP[0] = False


@functools.cache
def _requested_by_name(func: Any) -> frozenset[str]:
    """Fixtures a test asks for at run time: ``request.getfixturevalue("redis_url")``."""
    info = _module(getattr(func, "__module__", ""))
    node = info.defs.get(getattr(func, "__name__", "")) if info else None
    found = set()
    for sub in ast.walk(node) if node is not None else ():
        if (
            isinstance(sub, ast.Call)
            and isinstance(sub.func, ast.Attribute)
            and sub.func.attr == "getfixturevalue"
            and sub.args
            and isinstance(sub.args[0], ast.Constant)
        ):
            found.add(str(sub.args[0].value))
    return frozenset(found)


def _closure(item: Any, names: Iterable[str]) -> set[str]:
    """``names`` and every fixture they depend on, as pytest would resolve them for ``item``."""
    manager = item.session._fixturemanager
    todo, found = list(names), set()
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        for fixturedef in manager.getfixturedefs(name, item) or ():
            todo.extend(fixturedef.argnames)
    return found


@contextlib.contextmanager
def no_gc_pauses() -> Iterator[None]:
    """Collect without the cyclic GC: parsing hundreds of modules makes objects fast enough to
    start full collections over the whole (torch-sized) heap, which costs more than the parse."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def tier_marks(item: Any) -> set[str]:
    """The tier marks ``item`` earns from its fixtures and its own code."""
    names = set(getattr(item, "fixturenames", ()))
    names |= _closure(item, _requested_by_name(getattr(item, "obj", None)))
    marks: set[str] = set()
    if names & REDIS_FIXTURES:
        marks.add("redis")
    if names & CELERY_FIXTURES:
        marks.add("celery")
    if names & SERVER_FIXTURES:
        marks.add("server")
    info = getattr(item, "_fixtureinfo", None)
    defs: Iterable[Any] = ()
    if info is not None:
        defs = (d for name in names for d in info.name2fixturedefs.get(name, ()))
    if any(function_spawns(d.func) for d in defs):
        marks.add("server")
    if function_spawns(getattr(item, "obj", None)):
        marks.add("server")
    return marks


def _server_addresses() -> set[tuple[str, int]]:
    addresses = set()
    for var, default in (
        ("GPUHEDGE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
        ("GPUHEDGE_TEST_AMQP_URL", "amqp://127.0.0.1:5672//"),
    ):
        url = urllib.parse.urlsplit(os.environ.get(var) or default)
        addresses.add((url.hostname or "127.0.0.1", url.port or 0))
    return {(host if host != "localhost" else "127.0.0.1", port) for host, port in addresses}


class ProcessGuard:
    """In the fast tier, starting a process or reaching the test servers fails the test."""

    def __init__(self) -> None:
        self.servers = _server_addresses()
        self.saved: list[tuple[Any, str, Any]] = []

    def _patch(self, owner: Any, attr: str, replacement: Any) -> None:
        self.saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, replacement)

    def __enter__(self) -> ProcessGuard:
        import multiprocessing.process

        def refuse(what: str) -> Any:
            def refused(*args: Any, **kwargs: Any) -> Any:
                raise AssertionError(
                    f"the fast tier does not start processes ({what}): mark the test or its "
                    "fixture so tests/support/tiers.py sees it (see its docstring)"
                )

            return refused

        execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]
        refused = refuse("subprocess")

        def guarded_child(popen: Any, args: Any, executable: Any, *rest: Any) -> Any:
            program = args if isinstance(args, str | bytes) else args[0]
            if os.path.basename(os.fsdecode(executable or program)) in MACHINE_TOOLS:
                return execute_child(popen, args, executable, *rest)
            return refused()

        self._patch(subprocess.Popen, "_execute_child", guarded_child)
        self._patch(multiprocessing.process.BaseProcess, "start", refuse("multiprocessing"))
        self._patch(os, "fork", refuse("os.fork"))
        connect = socket.socket.connect
        servers = self.servers

        def guarded_connect(sock: socket.socket, address: Any) -> Any:
            if isinstance(address, tuple) and (address[0], address[1]) in servers:
                raise AssertionError(
                    f"the fast tier does not reach the test servers ({address[0]}:{address[1]})"
                )
            return connect(sock, address)

        self._patch(socket.socket, "connect", guarded_connect)
        return self

    def __exit__(self, *exc: Any) -> None:
        while self.saved:
            owner, attr, original = self.saved.pop()
            setattr(owner, attr, original)
