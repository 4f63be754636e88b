"""The docs place every measurement by date, time or commit, never by a work session or "today":
a reader without the project's history cannot tell which session or day that was."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
DIARY = re.compile(
    r"\b(?:this|that|the same|one|first|second|third|fourth|fifth|previous|next|earlier|later)"
    r" session\b|\bsession's\b|\btoday's (?:code|runs?)\b|\bour reading\b",
    re.I,
)


def diary_phrases(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        found += [f"line {number}: {match.group(0)!r}" for match in DIARY.finditer(line)]
    return found


@pytest.mark.parametrize(
    ("text", "hit"),
    [
        ("met in every run of this session", True),
        ("the third session's full run", True),
        ("5,000 in flight was met in 2 of 10 runs of today's code", True),
        ("(our reading: each timer claim is a round trip)", True),
        ("measured 2026-12-02, 12:00-12:05 UTC, commit a64a94b", False),
        ("an HTTP session reused across polls", False),
        ("today's day cap", False),
    ],
)
def test_the_scanner_tells_diary_phrases_from_plain_words(text, hit):
    assert bool(diary_phrases(text)) is hit


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_doc_places_a_measurement_by_session_or_today(path):
    found = diary_phrases(path.read_text())
    assert not found, f"{path.relative_to(REPO)}: {found}"
