"""A circuit's budget: its defaults by device, what it costs, and how its curve's points split.

A circuit's work is its gradient passes (``steps`` per pair), its exact checks (``verify``
per pair) and its faithfulness curve (``curve`` points per pair). :data:`DEVICE_DEFAULTS` sizes
them for the device; :func:`estimate_line` says before the work about how long it takes,
counted in forwards and timed on the planner's own captures; :func:`curve_points` splits
``curve=N`` into the grid and the bisection, so that N is the number of points measured.
"""

from __future__ import annotations

from .._engine import duration

__all__ = ["DEVICE_DEFAULTS", "REFINE", "curve_points", "estimate_line", "gap_middles", "grid_sizes"]

#: The most of a curve's points spent halving the size bracket around the share (the size
#: reported is then within 1/64 of the bracket of the first grid point past the share); a third
#: of the points at most, so that the grid keeps the curve's shape.
REFINE = 6


def curve_points(points: int) -> tuple[int, int]:
    """``curve=points`` split into ``(grid points, bisection points)``: a third of them (at
    most :data:`REFINE`) narrow the smallest circuit reaching the share, the rest are the grid."""
    refine = min(REFINE, points // 3)
    return points - refine, refine


def grid_sizes(total: int, points: int) -> list[int]:
    """``points`` distinct circuit sizes from 0 (no edge) to ``total`` (every edge), spaced
    geometrically in between (every size where there are no more than ``points``)."""
    if points >= total + 1:
        return list(range(total + 1))
    inner = points - 1  # sizes from 1 to total
    sizes = [0]
    for i in range(inner):
        sizes.append(max(round(total ** (i / max(inner - 1, 1))), sizes[-1] + 1))
    sizes[-1] = total
    for i in range(len(sizes) - 2, 0, -1):  # rounding may crowd the top: step back, one edge apart at least
        sizes[i] = min(sizes[i], sizes[i + 1] - 1)
    return sizes


def gap_middles(sizes: list[int], n: int) -> list[int]:
    """Up to ``n`` new sizes between the measured ``sizes`` (sorted), each the geometric middle
    of the widest gap (by ratio, as the grid is spaced) left at its turn."""
    taken, added = list(sizes), []
    for _ in range(max(n, 0)):
        gaps = [(a, b) for a, b in zip(taken, taken[1:]) if b - a > 1]
        if not gaps:
            break
        a, b = max(gaps, key=lambda gap: (gap[1] + 1) / (gap[0] + 1))
        middle = min(max(round(((a + 1) * (b + 1)) ** 0.5) - 1, a + 1), b - 1)
        added.append(middle)
        taken = sorted([*taken, middle])
    return sorted(added)


#: The defaults of ``steps``, ``verify`` and ``curve`` by the device the model runs on. A GPU
#: runs the full budget in about a minute on a small model; a CPU runs a forward tens of times
#: slower, so its defaults are cut to what still gives an EAP-IG ranking, a check of its top
#: edges and the curve's shape, in minutes rather than an hour.
DEVICE_DEFAULTS = {"cuda": {"steps": 5, "verify": 20, "curve": 16}, "cpu": {"steps": 3, "verify": 10, "curve": 6}}

#: A circuit's work in forwards of a pair's prompt (what the estimate counts, times the
#: planner's own timed captures): an EAP-IG step is a forward and a backward (about two
#: forwards); an exact check is path patching's two runs; a curve point runs every receiver on
#: its own input (the attention heads' query, key and value apart), about three forwards.
FORWARDS_PER_STEP, FORWARDS_PER_CHECK, FORWARDS_PER_POINT = 3, 2, 3


def estimate_line(seconds_per_forward: float, n_pairs: int, device: str, method: str, steps: int | None,
                   verify: int, points: int) -> str:
    """One line: about how long the circuit takes (its forwards, :data:`FORWARDS_PER_STEP` ...,
    times the seconds of one forward measured on the captures) and what cuts it."""
    forwards = n_pairs * ((steps or 0) * FORWARDS_PER_STEP + verify * FORWARDS_PER_CHECK + points * FORWARDS_PER_POINT)
    scoring = f"{method} with {steps} step{'s' if steps != 1 else ''}, " if steps else ""
    return (f"circuit: {duration(forwards * seconds_per_forward)} on this {device} ({n_pairs} pair{'s' if n_pairs != 1 else ''}, {scoring}"
            f"{verify} exact checks, a {points}-point curve); fewer steps=, verify= or curve= make it shorter")
