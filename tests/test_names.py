"""Celery queue and task names are spelled out in gpuhedge_celery/names.py only, and Redis keys
are built from a deployment's prefix in store/keys.py and store/race_keys.py only: everything
else imports them."""

from __future__ import annotations

import ast
import pathlib
import re

from gpuhedge_celery import names
from gpuhedge_celery.store.keys import Keys, all_keys
from gpuhedge_celery.store.race_keys import (
    RaceShards,
    budget_keys,
    race_key_head,
    race_key_part,
    race_keys,
    race_keys_pattern,
    shard_indexes,
    timer_keys,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpuhedge_celery"
NAMES_HOME = "gpuhedge_celery/names.py"
KEYS_HOMES = {"gpuhedge_celery/store/keys.py", "gpuhedge_celery/store/race_keys.py"}
CELERY_NAME = re.compile(r"^gpuhedge\.[a-z_][a-z_.]*$")
NOT_CELERY = (".yaml", ".yml", ".json", ".py")  # file names such as config/gpuhedge.yaml


def _docstrings(tree: ast.AST) -> set[ast.AST]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            found.add(body[0].value)
    return found


def _names_prefix(node: ast.AST) -> bool:
    """Whether ``node`` is a variable or attribute named like a key prefix."""
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return "prefix" in name.lower()


def spelled_names(path: pathlib.Path) -> list[str]:
    """``line: name '...'`` for each Celery name, ``line: key ...`` for each Redis key built
    from a prefix, in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            if (
                node not in docstrings
                and CELERY_NAME.match(value)
                and not value.endswith(NOT_CELERY)
            ):
                found.append((node.lineno, f"name {value!r}"))
        elif isinstance(node, ast.JoinedStr):
            parts = node.values
            for here, after in zip(parts, parts[1:], strict=False):
                if not (isinstance(here, ast.FormattedValue) and _names_prefix(here.value)):
                    continue
                text = after.value if isinstance(after, ast.Constant) else ""
                # f"{prefix}:" alone is a prefix (a broker prefix's value), not a key
                if (
                    isinstance(after, ast.Constant)
                    and text.startswith(":")
                    and (len(text) > 1 or after is not parts[-1])
                ):
                    found.append((node.lineno, f"key {ast.unparse(node)}"))
                    break
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            right = node.right
            if (
                _names_prefix(node.left)
                and isinstance(right, ast.Constant)
                and str(right.value).startswith(":")
            ):
                found.append((node.lineno, f"key {ast.unparse(node)}"))
    return [f"{line}: {what}" for line, what in sorted(found)]


def _what(found: list[str]) -> set[str]:
    return {line.split(": ", 1)[1] for line in found}


def test_celery_names_and_redis_keys_are_spelled_out_in_their_modules_only():
    outside = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        found = spelled_names(path)
        if relative == NAMES_HOME:
            found = [line for line in found if not line.split(": ", 1)[1].startswith("name ")]
        if relative in KEYS_HOMES:
            found = [line for line in found if not line.split(": ", 1)[1].startswith("key ")]
        if found:
            outside[relative] = found
    assert not outside, (
        "import queue and task names from gpuhedge_celery.names and Redis keys from "
        f"store/keys.py or store/race_keys.py: {outside}"
    )


def test_the_scanner_finds_names_and_keys_but_not_prose_or_prefix_values(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""Sent to gpuhedge.coord (prose)."""\n'
        'q = "gpuhedge.coord"\n'
        'k = f"{prefix}:race:{{{rid}}}"\n'
        'j = f"{store.keys.prefix}:{name}"\n'
        'b = prefix + ":stop"\n'
        'broker = f"{prefix}:"\n'
        'path = "gpuhedge.yaml"\n'
        'url = f"{host}:{port}"\n'
    )
    assert [int(line.split(":")[0]) for line in spelled_names(sample)] == [2, 3, 4, 5]


def test_the_names_every_deployment_and_other_apps_rely_on_are_unchanged():
    assert names.COORD_QUEUES == ("gpuhedge.coord", "gpuhedge.attempts", "gpuhedge.pool")
    assert names.gpu_queue("box:0") == "gpuhedge.gpu.box:0"
    assert names.RACE_TASKS == {
        "gpuhedge.hedged_infer", "gpuhedge.race_step", "gpuhedge.race_submit",
        "gpuhedge.race_cancel",
    }  # fmt: skip
    keys = Keys("p")
    assert (keys.lease("a", "h:0"), keys.pool_gpus("a"), keys.gpu_pools()) == (
        "p:{pool:a}:lease:h:0", "p:{pool:a}:gpus", "p:gpu-pools",
    )  # fmt: skip
    assert (keys.stop("a", "t"), keys.janitor_lock(), keys.dead_since()) == (
        "p:{pool:a}:stop:t", "p:janitor:lock", "p:reconcile:dead_since",
    )  # fmt: skip
    assert all_keys("p") == "p:*"
    assert race_keys("p", "races", "r1").receipt == "p:race:{races}:r1:receipt"
    assert RaceShards("p").race("r1").receipt == "p:race:{races}:r1:receipt"
    assert RaceShards("p").index_of("r1") == shard_indexes("p", "races")
    assert (shard_indexes("p", "races").live, shard_indexes("p", "races").records) == (
        "p:{races}:live", "p:{races}:records",
    )  # fmt: skip
    assert timer_keys("p", "races").due == "p:{races}:due"
    assert budget_keys("p").reservation("r/a") == "p:{budget}:res:r/a"
    assert race_key_head("p") == "p:race:{"
    assert race_key_part("p", "p:race:{races}:r1:state") == ("r1", "state")
    assert race_key_part("p", "p:race:{races-2.7}:a:b:owner_seq") == ("a:b", "owner_seq")
    assert race_key_part("p", "p:race:{r1}:state") is None  # no race id
    assert race_key_part("p", "p:{races}:live") is None
    assert race_keys_pattern("p", "ab") == "p:race:{*}:ab*"
