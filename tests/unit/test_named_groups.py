"""Averages over many prompts, aligned by named positions, on the real embedded model."""

from __future__ import annotations

from pipatch._experiments.dataset import named_groups

NAMES = ["before", "first subject", "middle subject", "last subject", "first after", "further", "last"]


def test_named_groups_cover_every_position_once():
    names, groups = named_groups([2, 3, 4], 9)
    assert names == NAMES
    assert groups == [[0, 1], [2], [3], [4], [5], [6, 7], [8]]
    # A one-token subject right before the last token is both first and last; no middle,
    # no "first after".
    names, groups = named_groups([3], 5)
    assert groups == [[0, 1, 2], [3], [], [3], [], [], [4]]
