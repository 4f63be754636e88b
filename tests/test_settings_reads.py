"""``GPUHEDGE_*`` variables are read in settings.py, envvars.py and cli.py only; everything else
takes ``settings.current()`` (or a section of it), and docs/configuration.md lists exactly the
variables those files read."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from gpuhedge_celery import settings as process_settings
from gpuhedge_celery.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpuhedge_celery"
# settings.py: the object; envvars.py: its parsers; cli.py: click resolves the three global
# options from their variables itself (so ``demo`` can tell a --config from the environment's)
ALLOWED = {"gpuhedge_celery/settings.py", "gpuhedge_celery/envvars.py", "gpuhedge_celery/cli.py"}
NAME = re.compile(r"^GPUHEDGE_[A-Z0-9_]+$")
FRAGMENT = re.compile(r"^GPUHEDGE_[A-Z0-9_]*$")  # the start of a name built at run time
DOCS = ROOT / "docs" / "configuration.md"
TABLE_TITLE = "## Environment variables"


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _key_defaults(tree: ast.AST) -> set[ast.AST]:
    """Defaults of parameters named ``key``: the variable an error names, not one read."""
    found: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            with_defaults = positional[len(positional) - len(args.defaults) :]
            for arg, default in zip(with_defaults, args.defaults, strict=True):
                if arg.arg == "key":
                    found.add(default)
            for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
                if arg.arg == "key" and default is not None:
                    found.add(default)
    return found


def _is_write(node: ast.AST, parent: ast.AST | None, key_defaults: set[ast.AST]) -> bool:
    """Naming a variable to set it for a child process or in an error is no read."""
    if isinstance(parent, ast.Dict) and node in parent.keys:
        return True  # {"GPUHEDGE_X": value}: a child's environment
    if isinstance(parent, ast.Subscript) and not isinstance(parent.ctx, ast.Load):
        return True  # env["GPUHEDGE_X"] = value / del env[...]
    if isinstance(parent, ast.keyword) and parent.arg == "key":
        return True  # ConfigError(..., key="GPUHEDGE_X")
    return node in key_defaults


def env_reads(path: pathlib.Path) -> list[str]:
    """``line: what`` for each place ``path`` reads (or names, to read) a GPUHEDGE_ variable."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parents = _parents(tree)
    key_defaults = _key_defaults(tree)
    found = []
    for node in ast.walk(tree):
        parent = parents.get(node)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if isinstance(parent, ast.JoinedStr):
                continue  # judged with its f-string below
            if NAME.match(node.value) and not _is_write(node, parent, key_defaults):
                found.append(f"{node.lineno}: {node.value}")
        elif isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            if isinstance(first, ast.Constant) and FRAGMENT.match(str(first.value)):
                if len(node.values) > 1 and not _is_write(node, parent, key_defaults):
                    found.append(f"{node.lineno}: {first.value}... (built at run time)")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left = node.left
            if isinstance(left, ast.Constant) and FRAGMENT.match(str(left.value)):
                found.append(f"{node.lineno}: {left.value}+... (built at run time)")
        elif isinstance(node, ast.keyword) and node.arg == "envvar":
            found.append(f"{node.lineno}: envvar= (click reads the variable)")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def package_reads() -> dict[str, list[str]]:
    reads = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found = env_reads(path)
        if found:
            reads[path.relative_to(ROOT).as_posix()] = found
    return reads


def test_gpuhedge_variables_are_read_only_in_the_settings_files():
    outside = {path: found for path, found in package_reads().items() if path not in ALLOWED}
    assert not outside, (
        "GPUHEDGE_ variables read outside settings.py/envvars.py/cli.py: parse them in "
        "envvars.py, reach them through a section of settings.ProcessSettings (code takes "
        "settings.current()), and list them in docs/configuration.md, *Environment "
        f"variables*: {outside}"
    )


def test_the_scanner_sees_reads_and_lets_writes_and_error_keys_pass(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\n"
        'a = os.environ.get("GPUHEDGE_A")\n'
        'b = os.environ["GPUHEDGE_B"]\n'
        'VAR = "GPUHEDGE_C"\n'
        'd = os.environ.get(f"GPUHEDGE_{a}")\n'
        'e = os.getenv("GPUHEDGE_" + a)\n'
        'env = {"GPUHEDGE_W": "1"}\n'
        'env["GPUHEDGE_W2"] = "2"\n'
        'raise ValueError("set GPUHEDGE_W3 first", key="GPUHEDGE_W4")\n'
        'def f(text, key="GPUHEDGE_W5"): ...\n'
    )
    lines = [int(found.split(":")[0]) for found in env_reads(sample)]
    assert lines == [2, 3, 4, 5, 6]


def documented_variables() -> list[str]:
    """The names in the first column of the docs' variables table, in order."""
    text = DOCS.read_text()
    assert TABLE_TITLE in text, f"docs/configuration.md has no {TABLE_TITLE!r} section"
    section = text.split(TABLE_TITLE, 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        cell = line.split("|")[1].strip() if line.startswith("|") else ""
        match = re.fullmatch(r"`(GPUHEDGE_[A-Z0-9_]+)`", cell)
        if match:
            names.append(match.group(1))
    return names


def variables_read() -> set[str]:
    """Every variable the settings files read (a settings object reads them all on its own)."""
    names = set()
    for path in ALLOWED:
        for found in env_reads(ROOT / path):
            what = found.split(": ", 1)[1]
            if NAME.match(what):
                names.add(what)
    return names


def test_the_docs_table_lists_exactly_the_variables_the_settings_read():
    documented = documented_variables()
    assert len(documented) == len(set(documented)), "a variable is listed twice"
    read = variables_read()
    assert set(documented) == read, {
        "read but not documented": sorted(read - set(documented)),
        "documented but never read": sorted(set(documented) - read),
    }


def test_every_section_parses_from_an_empty_environment():
    every = process_settings.ProcessSettings.from_env({})
    assert every.core.prefix == "gpuhedge"
    assert every.glue.pool == "default"
    assert every.race.timer_namespace == "races"
    assert not every.webhooks.on
    assert every.janitor.limit == 100
    assert every.metrics.port is None and every.metrics.enabled
    assert every.runner_env == frozenset()


def test_a_section_is_parsed_once_and_reload_reads_the_environment_again(monkeypatch):
    monkeypatch.setenv("GPUHEDGE_JANITOR_LIMIT", "7")
    first = process_settings.reload()
    assert process_settings.current() is first
    assert first.janitor.limit == 7
    monkeypatch.setenv("GPUHEDGE_JANITOR_LIMIT", "8")
    assert process_settings.current().janitor.limit == 7  # kept
    assert process_settings.reload().janitor.limit == 8
    monkeypatch.delenv("GPUHEDGE_JANITOR_LIMIT")
    process_settings.reload()


def test_a_bad_value_fails_only_the_section_that_reads_it():
    every = process_settings.ProcessSettings.from_env({"GPUHEDGE_TIMER_NAMESPACE": "a b"})
    assert every.glue.pool == "default"
    assert every.receipt_ttl_s == 86400.0
    with pytest.raises(ConfigError, match="GPUHEDGE_TIMER_NAMESPACE: expected letters"):
        every.race  # noqa: B018 - parsed on first use


def test_a_retired_switch_still_set_is_named_in_one_warning_line():
    from gpuhedge_celery.envvars import retired_set

    env = {"GPUHEDGE_COORD_LOOP": "threads", "GPUHEDGE_TIMER_THREADS": "4"}
    assert retired_set(env) == [
        "GPUHEDGE_COORD_LOOP is set but no longer read: the batched coordination loop is the "
        "only one"
    ]
    assert retired_set({}) == []
