"""Noise scales that do not mix: the one line said where results of several scales meet.

A trace's normalized recovery is measured against the run its noise corrupted, and that run
depends on the noise scale (``scale × σ``): recovery at 1σ and at 2σ are not one quantity.
ROME uses one fixed multiple of σ for every fact; ``scale="auto"`` picks a scale per prompt, so
two traces, or a study's facts, may differ. Where results meet (:func:`pipatch.compare`, a
study's averages, a list-form dataset) :func:`mixed_scales` says which result has which
scale and the fix. A result without a noise scale (a patch, a lens) is no part of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["mixed_scales"]


def mixed_scales(named: Iterable[tuple[str, Any]], what: str) -> str | None:
    """One line naming the results of each noise scale and the fix, or ``None`` where the
    scales given (``(name, scale)`` pairs; ``None`` for a result without one) agree.

    The fix is the largest scale: ``scale="auto"`` chose each result's as the smallest that
    collapsed its answer, so the largest is the one that collapses every one of them."""
    by_scale: dict[float, list[str]] = {}
    for name, scale in named:
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            by_scale.setdefault(float(scale), []).append(name)
    if len(by_scale) < 2:
        return None
    said = "; ".join(f"{scale:g}σ: {_names(names)}" for scale, names in sorted(by_scale.items()))
    return (f"{what} mix noise scales ({said}), so their recoveries are measured against different corruptions: "
            f"rerun with scale={max(by_scale):g}")


def _names(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
