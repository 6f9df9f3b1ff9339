"""The reports' helpers: one quantile for every p50/p99 of the demo, the benches and tune."""

from __future__ import annotations

import math

from kvd.tables import format_table, quantile


def test_quantile_is_a_measured_value_by_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert quantile(values, 0.50) == 51.0  # the value at index floor(0.5 * 100)
    assert quantile(values, 0.99) == 100.0
    assert quantile(values, 1.0) == 100.0, "q = 1 is the largest"
    assert quantile([1.0, 2.0, 10.0], 0.99) == 10.0, "no interpolation between 2 and 10"
    assert quantile([7.0], 0.5) == 7.0
    assert math.isnan(quantile([], 0.99))


def test_table_columns_align() -> None:
    rows = [["name", "n"], ["a", "10"], ["long", "2"]]
    assert format_table(rows, right=(1,)) == ["name   n", "a     10", "long   2"]
