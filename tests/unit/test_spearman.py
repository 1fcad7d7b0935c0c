"""The rank correlation that attribution and circuits report: ties share a rank, order reversed is -1.

Attribution against exact patches on real models: ``tests/integration/test_attribution.py``.
"""

from __future__ import annotations

import pytest
import torch

from pipatch._experiments.attribution import spearman


def test_spearman_handles_ties():
    # Exactly ±1 by construction (monotone with shared ranks, reversed): approx's default 1e-6
    # relative is the float rounding of the correlation's arithmetic.
    assert spearman(torch.tensor([0.0, 0.0, 1.0, 2.0]), torch.tensor([0.0, 0.0, 3.0, 5.0])) == pytest.approx(1.0)
    assert spearman(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0])) == pytest.approx(-1.0)
