#!/usr/bin/env python3
"""Render the JSON of ``gpuhedge-celery bench NAME --json`` files as Markdown tables.

Usage: ``python3 scripts/bench_table.py DIR`` (every ``*.json`` in DIR, one table per bench).
Columns are the result rows' keys in first-seen order; nested values are printed as compact JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def table(rows: list[dict]) -> str:
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def main(folder: str) -> None:
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        rows = data.get("results", []) if isinstance(data, dict) else data
        extra = {k: v for k, v in data.items() if k not in ("bench", "results")}
        print(f"### bench {data.get('bench', path.stem)}\n")
        if extra:
            print("run: `" + json.dumps(extra, separators=(",", ":")) + "`\n")
        print(table([r for r in rows if isinstance(r, dict)]) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-results")
