"""The repository stands on its own: no link or path that leads outside it, no talk of tickets.

Docs, code, configs, deployment files, scripts, examples and tests are read by people who have
only this repository. So nothing may point at a sibling directory (``../shared/...``) or cite an
issue tracker ("issue 4", "the issue's wording"); every relative Markdown link resolves to a file
inside the repository; the README's documentation index lists every file under ``docs/``; and
every test a doc cites as evidence (``tests/test_x.py``, ``tests/test_x.py::test_name``) exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCANNED = ["docs", "README.md", "gpuhedge_celery", "config", "deploy", "workers", "scripts",
           "examples", "tests"]  # fmt: skip
SKIPPED = {Path(__file__).resolve(), REPO / "tests" / "data"}

# What a reader outside the project cannot follow.
FORBIDDEN = [
    (re.compile(r"\.\./shared\b"), "a path outside the repository"),
    (re.compile(r"\bissues?\s*(?:#\s*)?\d+", re.I), "an issue number"),
    (re.compile(r"\bthe\s+issues?\b", re.I), "a reference to an issue"),
    (re.compile(r"\bissue's\b", re.I), "a reference to an issue"),
]
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A cited test file, optionally with one test of it: tests/test_x.py or tests/test_x.py::test_y
CITED_TEST = re.compile(r"\btests/((?:[\w-]+/)*test_\w+\.py)(?:::(\w+))?")
# A test named on its own, in backticks: `test_y`
NAMED_TEST = re.compile(r"`(test_\w+)`")
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]


def problems(text: str) -> list[str]:
    """One entry per forbidden phrase in ``text``: ``line N: <why>: <match>``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, why in FORBIDDEN:
            for match in pattern.finditer(line):
                found.append(f"line {number}: {why}: {match.group(0)!r}")
    return found


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        root = REPO / name
        for path in [root] if root.is_file() else sorted(root.rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            if any(path == s or s in path.parents for s in SKIPPED):
                continue
            files.append(path)
    return files


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data[:4096]:
        return None  # binary
    return data.decode("utf-8", errors="replace")


@pytest.mark.parametrize(
    ("text", "hit"),
    [
        ("see ../shared/FACTS.md", True),
        ("(issue 4 section 4)", True),
        ("Replay (Issue #3)", True),
        ("the claim the issue asks for", True),
        ("Targets come from the issues;", True),
        ("where this differs from the issue's wording", True),
        ("claim.lua: take a lease and issue the next fencing token", False),
        ("the handle it issues", False),
        ("a known issue with kombu", False),
    ],
)
def test_the_scanner_tells_references_from_plain_words(text, hit):
    assert bool(problems(text)) is hit, problems(text)


def test_no_file_points_outside_the_repository_or_at_issues():
    files = scanned_files()
    assert len(files) > 100, "the scan found the repository's files"
    bad = []
    for path in files:
        text = _text(path)
        if text is not None:
            bad += [f"{path.relative_to(REPO)}: {p}" for p in problems(text)]
    assert not bad, "\n".join(bad)


def test_relative_markdown_links_resolve_inside_the_repository():
    bad = []
    for path in [p for p in scanned_files() if p.suffix == ".md"]:
        for target in MD_LINK.findall(path.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same file
            resolved = (path.parent / target.split("#")[0]).resolve()
            if REPO not in resolved.parents and resolved != REPO or not resolved.exists():
                bad.append(f"{path.relative_to(REPO)}: {target}")
    assert not bad, bad


def test_the_readme_indexes_every_doc():
    readme = (REPO / "README.md").read_text()
    index = readme[readme.index("## Documentation") :]
    index = index[: index.index("\n## ", 1)]
    docs = sorted((REPO / "docs").glob("*.md"))
    missing = [p.name for p in docs if f"docs/{p.name}" not in index]
    assert not missing, f"README's documentation index lacks {missing}"


def cited_tests(text: str) -> list[tuple[str, str | None]]:
    """(path under tests/, test name or None) for every test ``text`` cites."""
    return [(f"tests/{path}", name or None) for path, name in CITED_TEST.findall(text)]


def missing_citations(text: str, root: Path = REPO) -> list[str]:
    """The cited tests of ``text`` that do not exist: no such file, or no such test in it."""
    bad = []
    for path, name in cited_tests(text):
        file = root / path
        if not file.is_file():
            bad.append(f"{path}: no such file")
        elif name and not re.search(rf"^(?:async )?def {name}\(", file.read_text(), re.M):
            bad.append(f"{path}::{name}: no such test")
    return bad


def test_the_citation_check_finds_files_and_tests_that_do_not_exist():
    here = Path(__file__).name
    text = (
        f"shown by tests/{here} and tests/{here}::test_the_readme_indexes_every_doc; "
        f"not by tests/test_nowhere.py or tests/{here}::test_nothing_like_this"
    )
    assert [name for _path, name in cited_tests(text)] == [
        None, "test_the_readme_indexes_every_doc", None, "test_nothing_like_this"
    ]  # fmt: skip
    assert missing_citations(text) == [
        "tests/test_nowhere.py: no such file",
        f"tests/{here}::test_nothing_like_this: no such test",
    ]


def test_every_test_a_doc_cites_exists():
    defined = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        defined |= set(re.findall(r"^(?:async )?def (test_\w+)\(", path.read_text(), re.M))
    bad, cited = [], 0
    for doc in DOCS:
        text = doc.read_text()
        cited += len(cited_tests(text))
        bad += [f"{doc.relative_to(REPO)}: {why}" for why in missing_citations(text)]
        bad += [f"{doc.relative_to(REPO)}: no test named {name}"
                for name in NAMED_TEST.findall(text) if name not in defined]  # fmt: skip
    assert cited > 50, "the docs cite their tests"
    assert not bad, "\n".join(bad)
