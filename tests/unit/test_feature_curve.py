"""A feature circuit's faithfulness curve without a model: the sizes it measures, and its
table's arithmetic (Marks et al.'s ratios) from the metrics a run stores."""

from __future__ import annotations

import math

import pytest

from pipatch._experiments._feature_checks import curve_sizes
from pipatch._results.feature_circuit import faithfulness_rows


def test_sizes_run_from_one_to_every_node_with_the_circuits_own():
    assert curve_sizes(4, 1000, 30) == [1, 10, 30, 100, 1000]
    assert curve_sizes(3, 5, 5) == [1, 2, 5]
    assert curve_sizes(8, 3, 2) == [1, 2, 3]  # fewer where the graph has fewer nodes
    assert curve_sizes(0, 1000, 30) == [] and curve_sizes(5, 0, 0) == []


def test_rows_are_marks_et_al_ratios_and_nan_until_measured():
    curve = {"full": 3.0, "empty": -1.0, "points": [{"n_nodes": 1, "with": 1.0, "without": 2.0},
                                                   {"n_nodes": 4, "with": 3.0, "without": None}]}
    first, second = faithfulness_rows(curve)
    assert first == {"n_nodes": 1, "faithfulness": 0.5, "completeness": 0.75, "with": 1.0, "without": 2.0}
    assert second["faithfulness"] == 1.0 and math.isnan(second["completeness"])
    waiting = faithfulness_rows({**curve, "empty": None})
    assert all(math.isnan(row["faithfulness"]) for row in waiting)
    flat = faithfulness_rows({**curve, "empty": 3.0})  # m(M) = m(∅): no ratio
    assert math.isnan(flat[0]["faithfulness"])
    assert faithfulness_rows({**curve, "points": []}) == []
    # Exact inputs, float64 arithmetic on both sides: approx's default 1e-6 relative is rounding only.
    assert first["faithfulness"] == pytest.approx((1.0 + 1.0) / (3.0 + 1.0))
