"""Tables in the docs hold results a reader can scan: no Markdown table cell in docs/ or the
README is longer than :data:`MAX_CELL` characters (history belongs in a dated log section)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
MAX_CELL = 1500
FENCE = re.compile(r"^\s*(```|~~~)")
UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")


def table_cells(text: str) -> list[tuple[int, int, str]]:
    """``(line, column, text)`` of every cell of every table row outside code blocks (a row is
    a line that starts with ``|``; cells split at pipes not escaped with a backslash)."""
    cells, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        stripped = line.strip()
        if fenced or not stripped.startswith("|"):
            continue
        parts = UNESCAPED_PIPE.split(stripped)[1:]
        if parts and parts[-1] == "":
            parts = parts[:-1]  # the closing pipe
        cells += [(number, column, part.strip()) for column, part in enumerate(parts, 1)]
    return cells


def long_cells(text: str) -> list[str]:
    return [f"line {n}, column {c}: {len(cell)} characters ({cell[:60]}...)"
            for n, c, cell in table_cells(text) if len(cell) > MAX_CELL]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("| a | b |\n|---|---|\n| 1 | 2 |", ["a", "b", "---", "---", "1", "2"]),
        ("| `x \\| y` | z |", ["`x \\| y`", "z"]),  # an escaped pipe stays in its cell
        ("```\n| not | a table |\n```\n| yes |", ["yes"]),
        ("text with a | pipe in it", []),
    ],
)
def test_the_cell_reader_splits_rows_as_markdown_does(text, expected):
    assert [cell for _, _, cell in table_cells(text)] == expected


def test_a_cell_over_the_limit_is_found():
    row = "| short | " + "x" * (MAX_CELL + 1) + " |"
    [found] = long_cells(f"# t\n\n| a | b |\n|---|---|\n{row}\n")
    assert found.startswith(f"line 5, column 2: {MAX_CELL + 1} characters")
    assert long_cells("| short | " + "x" * MAX_CELL + " |") == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_table_cell_in_the_docs_is_a_diary(path):
    found = long_cells(path.read_text())
    assert not found, f"{path.relative_to(REPO)}: cells over {MAX_CELL} characters: {found}"
