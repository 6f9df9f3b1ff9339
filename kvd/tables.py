"""The commands' reports: one table helper, so every table aligns alike, and one quantile, so
every p50 and p99 of the demo, the benches and ``kvd tune`` means the same."""

from __future__ import annotations

import math
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


def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``ordered`` (sorted ascending), by nearest rank: the value at
    index ``floor(q * n)``, the largest for ``q = 1``; no interpolation, so a p99 is always a
    measured value. NaN when there are no values."""
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
