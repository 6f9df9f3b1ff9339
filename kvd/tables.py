"""Plain-text tables for the commands' reports: one helper, so every table aligns alike."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(rows: Sequence[Sequence[str]], *, right: Sequence[int] = ()) -> list[str]:
    """Lines of ``rows`` (the first is the header) in columns two spaces apart.

    Columns whose index is in ``right`` are right-aligned (numbers); the others left-aligned.
    """
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return lines
